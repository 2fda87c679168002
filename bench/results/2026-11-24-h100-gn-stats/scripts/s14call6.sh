# Session 14, call 6 (H200): the shipped tuning tables after the pixel path's new statistics kernel.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 400 python3 -m bench.tune > $R/tune.log 2>&1; echo "rc $?" >> $R/tune.log
cp -r sd_kernels/tuning $R/tuning
cd $OUT && tar czf r.tgz r && rm -rf r
