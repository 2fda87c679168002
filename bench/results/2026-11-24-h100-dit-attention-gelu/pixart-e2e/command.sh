# Session 13, call 3: linear_gelu GPU tests after the fp32 restriction; PixArt-Σ with both peer rows and ours unfused.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_gelu.py -k "linear_gelu" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 420 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cd $OUT && tar czf r.tgz r && rm -rf r
