# Session 14, call 9 (H100): SDXL 1024² end to end, the peer and ours best in one process, after the GroupNorm statistics change.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 560 python3 -m bench.e2e --out $R/e2e --models sdxl@1024 --variants stock+compile-graphs,patched+graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
