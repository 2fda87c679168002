# Session 15, call 4 (H100): the one-tile GroupNorm takes the shift too. Tables re-tuned, GPU tests of the shift and the
# patches, then the SD1.5 UNet step kernel for kernel: peer, ours (fold on), ours with the fold off (scratch/nofold.py).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 240 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
SD_KERNELS_AUTOTUNE=0 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_group_norm.py -k "shift or launch_count or channels_last" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
SD_KERNELS_AUTOTUNE=0 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_group_norm_patch.py tests/patches/test_gelu_patch.py >> $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 250 python3 -m bench.unet_kernels --out $R/k --setups peer,patched-compile-fused-qkv > $R/uk.log 2>&1; echo "rc $?" >> $R/uk.log
timeout 100 python3 scratch/nofold.py --out $R/k-nofold --setups patched-compile-fused-qkv > $R/uk-nofold.log 2>&1; echo "rc $?" >> $R/uk-nofold.log
cd $OUT && tar czf r.tgz r && rm -rf r
