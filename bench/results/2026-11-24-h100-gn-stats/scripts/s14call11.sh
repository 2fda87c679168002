# Session 14, call 11 (H100): tests/test_precompile.py's GPU tests alone (in call 10 they ran after the GroupNorm tests in one process).
set -u
R=$OUT/r; mkdir -p $R
SD_KERNELS_AUTOTUNE=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_precompile.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
