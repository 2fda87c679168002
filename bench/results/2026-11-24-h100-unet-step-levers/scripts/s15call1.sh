# Session 15, call 1 (H100): PDL for the Launcher kernels. Tables re-tuned first (the kernels' sources changed),
# then the SD1.5 UNet step kernel for kernel: ours with PDL on / off, and peer + ours with inductor's PDL.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda); from sd_kernels import pdl; print('pdl', pdl.enabled()); import torch._inductor.config as c; print('inductor enable_pdl', getattr(c.triton, 'enable_pdl', 'absent'))" >> $R/gpu.txt 2>&1
timeout 240 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
SD_KERNELS_AUTOTUNE=0 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -x tests/ops/test_attention.py tests/ops/test_gelu.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
SD_KERNELS_PDL=1 timeout 100 python3 -m bench.unet_kernels --out $R/k-pdl --setups patched-compile-fused-qkv > $R/uk-pdl.log 2>&1; echo "rc $?" >> $R/uk-pdl.log
SD_KERNELS_PDL=0 timeout 100 python3 -m bench.unet_kernels --out $R/k-nopdl --setups patched-compile-fused-qkv > $R/uk-nopdl.log 2>&1; echo "rc $?" >> $R/uk-nopdl.log
TORCHINDUCTOR_ENABLE_PDL=1 timeout 200 python3 -m bench.unet_kernels --out $R/k-ipdl --setups peer,patched-compile-fused-qkv > $R/uk-ipdl.log 2>&1; echo "rc $?" >> $R/uk-ipdl.log
cd $OUT && tar czf r.tgz r && rm -rf r
