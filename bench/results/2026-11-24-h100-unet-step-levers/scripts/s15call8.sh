# Session 15, calls 8 (H100) and 9 (H200): shifted GroupNorm calls have Launcher keys of their own; linear_geglu launches
# through a Launcher. bench.tune for both (the tables merge), then the precompile GPU test alone and the GroupNorm shift tests.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 300 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_precompile.py > $R/gpu-precompile.txt 2>&1; echo "rc $?" >> $R/gpu-precompile.txt
SD_KERNELS_AUTOTUNE=0 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_group_norm.py -k shift > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
