# Session 14, call 3: the pixel path's statistics launch alone: HEAD's kernel, the flat Welford one, two pivot-sum ones; warps x programs.
set -u
R=$OUT/r; mkdir -p $R
timeout 400 python3 scratch/gnstats.py > $R/gnstats.txt 2>&1; echo "rc $?" >> $R/gnstats.txt
cd $OUT && tar czf r.tgz r && rm -rf r
