# Session 22, call 5: the wgmma attention kernel's GPU tests, its per-op timing, PixArt-Σ end to end.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 90 python3 -m pytest -q tests/ops/test_attention_wgmma.py > $R/pytest-wgmma.txt 2>&1; echo "rc $?" >> $R/pytest-wgmma.txt; tail -4 $R/pytest-wgmma.txt
timeout 80 python3 scratch/gl/bench_lib.py > $R/ops.txt 2>&1; echo "rc $?" >> $R/ops.txt; cut -c1-400 $R/ops.txt
timeout 380 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,patched+graph+compile,stock+compile-graphs > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-300 $R/bench-dit-pixart.txt | tail -30
cd $OUT && tar czf r.tgz r && rm -rf r
