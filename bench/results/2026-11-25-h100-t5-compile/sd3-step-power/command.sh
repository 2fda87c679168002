# Session 21, call G: the strengthened GPU test of T5 over the prompt's tokens (a second prompt replayed,
# a second length compiled), then SD3's transformer step timed inside the pipeline vs alone.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -rs --durations=0 tests/patches/test_text_padding.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
grep -E "PASS|FAIL|Error|rc " $R/gpu-tests.txt | tail -8
timeout 360 python3 scratch/sd3_step.py $R patched+graph+compile+fused-qkv,stock+compile-graphs > $R/sd3_step.txt 2>&1; echo "rc $?" >> $R/sd3_step.txt
grep -v Warn $R/sd3_step.txt | cut -c1-700 | tail -4
cd $OUT && tar czf r.tgz r && rm -rf r
