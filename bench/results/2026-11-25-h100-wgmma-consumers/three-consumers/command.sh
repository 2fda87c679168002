# Session 23, call 1: the wgmma kernel with 2 or 3 consumer warpgroups (GPU tests, both), swept against cuDNN at the
# DiT and UNet shapes; SD3-medium end to end with the fused joint processor and head dim 64 on the kernel; GPU tests.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 200 python3 -m pytest -q -x tests/ops/test_attention_wgmma.py > $R/pytest-wgmma.txt 2>&1; echo "rc $?" >> $R/pytest-wgmma.txt; tail -3 $R/pytest-wgmma.txt
timeout 130 python3 scratch/s23/bench_nc.py > $R/ops.txt 2>&1; echo "rc $?" >> $R/ops.txt; cut -c1-420 $R/ops.txt
SD_KERNELS_PROFILE=scratch/s23/hopper64.json timeout 200 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium --variants stock,patched+graph+compile+fused-qkv,stock+compile-graphs > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cut -c1-420 $R/bench-dit-sd3.txt | grep -v Warn | tail -5
timeout 100 python3 -m pytest -q -m gpu tests/patches/test_sd3_patch.py tests/patches/test_cuda_graph.py -k "not max-autotune" > $R/pytest-gpu.txt 2>&1; echo "rc $?" >> $R/pytest-gpu.txt; tail -3 $R/pytest-gpu.txt
