# Session 13, call 5: SD3-medium 1024² with both peer rows and ours unfused/fused, one process; bench.dit's GPU test.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 400 python3 -m bench.dit --out $R/dit-sd3 --model sd3-medium > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
SD_KERNELS_AUTOTUNE=0 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_bench.py -k dit > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
