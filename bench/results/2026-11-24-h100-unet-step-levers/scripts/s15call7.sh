# Session 15, calls 7 (H200) and 8 (H100): linear_geglu now launches through a Launcher: its tuning table (bench.tune),
# then the precompile GPU test (alone: it must be a fresh process) and the GELU family's GPU tests.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 300 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_precompile.py > $R/gpu-precompile.txt 2>&1; echo "rc $?" >> $R/gpu-precompile.txt
SD_KERNELS_AUTOTUNE=0 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_gelu.py tests/patches/test_gelu_patch.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
