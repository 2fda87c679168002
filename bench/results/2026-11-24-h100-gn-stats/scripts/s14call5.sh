# Session 14, call 5: the pivot-sum (4 warps allowed, no per-tile variant) statistics kernel: GN GPU tests, old-vs-new GroupNorm at SD shapes, H100 tuning tables.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 320 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -x tests/ops/test_group_norm.py tests/ops/test_group_stats.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
SD_KERNELS_SHIPPED_TUNING=0 SD_KERNELS_AUTOTUNE_CACHE=off timeout 120 python3 scratch/gnbench.py > $R/gnbench.txt 2>&1; echo "rc $?" >> $R/gnbench.txt
timeout 240 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
cd $OUT && tar czf r.tgz r && rm -rf r
