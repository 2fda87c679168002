set -x
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/r/gpu.txt
timeout 300 python3 scratch/gl/bench_gl.py 2>&1 | tee $OUT/r/log.txt | grep -v "^    " | tail -40
cd $OUT && tar czf r.tgz r && rm -rf r
