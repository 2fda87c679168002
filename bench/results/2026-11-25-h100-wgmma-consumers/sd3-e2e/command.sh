# Session 23, call 2: the wgmma kernel's GPU tests (2 and 3 consumers); SD3-medium 1024² end to end with the shipped
# hopper profile (head dim 64 on the kernel, 3 consumers), both peer rows, one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 150 python3 -m pytest -q tests/ops/test_attention_wgmma.py > $R/pytest-wgmma.txt 2>&1; echo "rc $?" >> $R/pytest-wgmma.txt; tail -3 $R/pytest-wgmma.txt
timeout 420 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium --variants stock,patched+graph+compile+fused-qkv,stock+compile-graphs,stock+compile-graphs-unfused-qkv > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cut -c1-420 $R/bench-dit-sd3.txt | grep -v Warn | tail -6
