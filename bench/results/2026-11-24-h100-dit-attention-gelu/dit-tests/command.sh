# Session 13, call 6: the DiT GPU tests after moving their shared checks into tests/patches/dit_checks.py.
set -u
R=$OUT/r; mkdir -p $R
SD_KERNELS_AUTOTUNE=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_flux_patch.py tests/patches/test_pixart_patch.py tests/patches/test_sd3_patch.py -k gpu > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
