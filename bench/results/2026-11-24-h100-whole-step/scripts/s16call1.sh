# Session 16, call 1 (H100): bench.tune on the H100 (its shifted GroupNorm keys and linear_geglu table held copied
# choices), then the precompile GPU test alone and the GELU op GPU suite.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 300 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_precompile.py > $R/gpu-precompile.txt 2>&1; echo "rc $?" >> $R/gpu-precompile.txt
SD_KERNELS_AUTOTUNE=0 timeout 190 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_gelu.py > $R/gpu-gelu.txt 2>&1; echo "rc $?" >> $R/gpu-gelu.txt
cd $OUT && tar czf r.tgz r && rm -rf r
