# Session 20, call 5: where PixArt's T5 encoder's 16 ms per call goes.
set -u
R=$OUT/r; mkdir -p $R
timeout 300 python3 scratch/t5prof.py $R > $R/t5.txt 2>&1; echo "rc $?" >> $R/t5.txt
grep -v Warning $R/t5.txt | tail -60
cd $OUT && tar czf r.tgz r && rm -rf r
