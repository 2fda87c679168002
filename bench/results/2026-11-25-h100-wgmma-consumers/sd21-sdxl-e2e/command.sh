# Session 23, call 4: the UNets' head-dim-64 self-attention now on the wgmma kernel (hopper): SD2.1 768² end to end,
# the peer and ours (best) in one process; SDXL 1024² ours (best) alone (its peer does not fit the same call).
set -u
R=$OUT/r4; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $R/gpu.txt
timeout 300 python3 -m bench.e2e --out $R/e2e-sd21 --models sd21@768 --variants stock+compile-graphs,patched+graph+compile+fused-qkv --no-ablation > $R/e2e-sd21.log 2>&1; echo "rc $?" >> $R/e2e-sd21.log
tail -4 $R/e2e-sd21.log | cut -c1-400
timeout 270 python3 -m bench.e2e --out $R/e2e-sdxl --models sdxl@1024 --variants patched+graph+compile+fused-qkv --no-ablation > $R/e2e-sdxl.log 2>&1; echo "rc $?" >> $R/e2e-sdxl.log
tail -4 $R/e2e-sdxl.log | cut -c1-400
