# Session 22, call 7: PixArt-Σ end to end again with the wgmma attention (stock, ours, the peer's faster row), one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 330 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,patched+graph+compile,stock+compile-graphs > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-300 $R/bench-dit-pixart.txt | grep -v Warn | tail -5
cd $OUT && tar czf r.tgz r && rm -rf r
