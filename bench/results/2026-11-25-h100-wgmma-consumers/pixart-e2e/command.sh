# Session 23, call 3: the wgmma GPU tests again (three consumers refused at head dim 128); PixArt-Σ 1024² end to end
# (stock, ours, the peer's faster row), one process; the SD3 and CUDA-graph GPU tests.
set -u
R=$OUT/r3; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 100 python3 -m pytest -q tests/ops/test_attention_wgmma.py > $R/pytest-wgmma.txt 2>&1; echo "rc $?" >> $R/pytest-wgmma.txt; tail -3 $R/pytest-wgmma.txt
timeout 280 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,patched+graph+compile,stock+compile-graphs > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-420 $R/bench-dit-pixart.txt | grep -v Warn | tail -5
timeout 190 python3 -m pytest -q -m gpu tests/patches/test_sd3_patch.py tests/patches/test_cuda_graph.py -k "not max-autotune" > $R/pytest-gpu.txt 2>&1; echo "rc $?" >> $R/pytest-gpu.txt; tail -3 $R/pytest-gpu.txt
