# Session 22, call 6: GPU tests after the kernel's rename; per-op timing incl. SD2's head-dim-64 shapes;
# PixArt-Σ end to end again (ours vs the peer); SD3 with the wgmma kernel also at head dim 64 (a profile file).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 90 python3 -m pytest -q tests/ops/test_attention_wgmma.py > $R/pytest-wgmma.txt 2>&1; echo "rc $?" >> $R/pytest-wgmma.txt; tail -3 $R/pytest-wgmma.txt
timeout 80 python3 scratch/gl/bench_lib.py > $R/ops.txt 2>&1; echo "rc $?" >> $R/ops.txt; cut -c1-330 $R/ops.txt
timeout 200 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants patched+graph+compile,stock+compile-graphs > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-300 $R/bench-dit-pixart.txt | grep -v Warn | tail -4
SD_KERNELS_PROFILE=$PWD/scratch/gl/hopper_wgmma64.json timeout 300 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium --variants patched+graph+compile+fused-qkv,stock+compile-graphs > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cut -c1-300 $R/bench-dit-sd3.txt | grep -v Warn | tail -4
cd $OUT && tar czf r.tgz r && rm -rf r
