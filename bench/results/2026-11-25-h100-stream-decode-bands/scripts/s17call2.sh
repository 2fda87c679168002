# Session 17, call 2 (H100): diagnostic of the streamed decode's peak (cuDNN workspace per conv shape) and plans at
# smaller planning shares (peak, eager, replayed, PSNR); then bench.stream_decode --graph (capture fixed).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
timeout 300 python3 scratch/s17diag.py $R/diag > $R/diag.txt 2>&1; echo "rc $?" >> $R/diag.txt
timeout 200 python3 -m bench.stream_decode --out $R/sd --graph > $R/bench-stream.txt 2>&1; echo "rc $?" >> $R/bench-stream.txt
cd $OUT && tar czf r.tgz r && rm -rf r
