# Session 21, call F: PixArt-Σ 1024² end to end again (a second machine's run of call A's comparison):
# stock, both peer rows and ours, in one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 575 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,patched+graph+compile,stock+compile-graphs,stock+compile-graphs-unfused-qkv > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-300 $R/bench-dit-pixart.txt
cd $OUT && tar czf r.tgz r && rm -rf r
