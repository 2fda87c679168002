# Session 14, call 10 (H100): GroupNorm GPU tests after the merge launch writes stat through a pointer of its own.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_group_norm.py tests/ops/test_group_stats.py tests/patches/test_group_norm_patch.py tests/test_precompile.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
