# Session 22, call 8: the scale folded into one FFMA per score (and a 4-stage ring) measured against call 4's kernel;
# GPU tests; PixArt-Σ end to end with the shipped kernel (stock, ours, the peer's faster row), one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 90 python3 -m pytest -q tests/ops/test_attention_wgmma.py > $R/pytest-wgmma.txt 2>&1; echo "rc $?" >> $R/pytest-wgmma.txt; tail -3 $R/pytest-wgmma.txt
timeout 70 python3 scratch/gl/bench_lib8.py > $R/ops.txt 2>&1; echo "rc $?" >> $R/ops.txt; cut -c1-400 $R/ops.txt
timeout 300 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,patched+graph+compile,stock+compile-graphs > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-300 $R/bench-dit-pixart.txt | grep -v Warn | tail -5
cd $OUT && tar czf r.tgz r && rm -rf r
