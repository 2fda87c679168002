# Session 14, call 7 (H100): SD1.5 after the GroupNorm statistics change: the UNet step kernel for kernel
# (peer vs ours, best) and end to end (peer, patch(pipe), ours best) in one process each.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__)" >> $R/gpu.txt
timeout 250 python3 -m bench.unet_kernels --out $R/k --setups peer,patched-compile-fused-qkv > $R/unet_kernels.log 2>&1; echo "rc $?" >> $R/unet_kernels.log
timeout 330 python3 -m bench.e2e --out $R/e2e --models sd15@512 --variants stock+compile-graphs,patched+graph,patched+graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
