# Session 15, call 2 (H100): every kernel of the SD1.5 UNet step (peer, ours best), ours with linear_geglu at K <= 320,
# and the GELU family's op benchmarks (linear_geglu / feed_forward on today's stack).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 250 python3 -m bench.unet_kernels --out $R/k --setups peer,patched-compile-fused-qkv > $R/uk.log 2>&1; echo "rc $?" >> $R/uk.log
SD_KERNELS_PROFILE=scratch/hopper-lg320.json timeout 120 python3 -m bench.unet_kernels --out $R/k-lg320 --setups patched-compile-fused-qkv > $R/uk-lg320.log 2>&1; echo "rc $?" >> $R/uk-lg320.log
timeout 180 python3 -m bench.run --out $R/gelu --only gelu > $R/gelu.log 2>&1; echo "rc $?" >> $R/gelu.log
cd $OUT && tar czf r.tgz r && rm -rf r
