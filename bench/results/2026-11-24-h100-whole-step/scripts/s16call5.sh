# Session 16, call 5 (H100): why whole-step graphs run the same kernels slower: one process, pipeline mode and
# whole-step mode alternating (no compile), kernel time by name from torch.profiler.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
timeout 400 python3 scratch/kernel_diff.py $R/kernel_diff.json > $R/kernel_diff.log 2>&1; echo "rc $?" >> $R/kernel_diff.log
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv >> $R/gpu.txt
cd $OUT && tar czf r.tgz r && rm -rf r
