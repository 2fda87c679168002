# Session 15, call 3 (H100): GroupNorm's shift (ResnetBlock2D's conv1 bias + temb folded into norm2) and linear_geglu at K <= 320
# in the hopper profile. Tables re-tuned (the pixel kernels' sources changed), the new GPU tests, then the SD1.5 UNet step
# kernel for kernel: peer and ours (hopper profile as shipped now), and ours with linear_geglu off (scratch/hopper-lg0.json).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 240 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
SD_KERNELS_AUTOTUNE=0 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -x tests/ops/test_group_norm.py -k "shift or launch_count" tests/patches/test_group_norm_patch.py tests/patches/test_gelu_patch.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 250 python3 -m bench.unet_kernels --out $R/k --setups peer,patched-compile-fused-qkv > $R/uk.log 2>&1; echo "rc $?" >> $R/uk.log
SD_KERNELS_PROFILE=scratch/hopper-lg0.json timeout 100 python3 -m bench.unet_kernels --out $R/k-lg0 --setups patched-compile-fused-qkv > $R/uk-lg0.log 2>&1; echo "rc $?" >> $R/uk-lg0.log
cd $OUT && tar czf r.tgz r && rm -rf r
