# Session 23, call 5 (run directly):
mkdir -p $OUT/r5; nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/r5/gpu.txt
timeout 200 python3 -m bench.ops_attention $OUT/r5 --wgmma > $OUT/r5/wgmma.log 2>&1
