# Session 13, call 2: linear_gelu (cuBLASLt GELU epilogue) tests + microbench; PixArt pipeline-mode test;
# PixArt-Σ and SD3-medium end to end with the epilogue and hopper's new attention routes.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_gelu.py -k "linear_gelu" tests/patches/test_pixart_patch.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 80 python3 -m bench.run --out $R/ops --only gelu --quick > $R/bench-gelu.txt 2>&1; echo "rc $?" >> $R/bench-gelu.txt
timeout 200 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
timeout 190 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cd $OUT && tar czf r.tgz r && rm -rf r
