# Session 20, call 6: T5-XXL replayed eager vs compiled.
set -u
R=$OUT/r; mkdir -p $R
timeout 420 python3 scratch/t5compile.py $R > $R/t5compile.txt 2>&1; echo "rc $?" >> $R/t5compile.txt
grep -v Warning $R/t5compile.txt | tail -20
cd $OUT && tar czf r.tgz r && rm -rf r
