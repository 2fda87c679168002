# Session 17, call 1 (H100): the rewritten streamed VAE decode (band ops, polyphase upsampler, a memory model that
# drops the input as the output grows): bench.stream_decode (eager and replayed, the untiled decode replayed too,
# segment peaks, the upsampler ops), its GPU tests, then the whole-image memory table (bench.memory --steps 20).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 220 python3 -m bench.stream_decode --out $R/sd --graph --profile > $R/bench-stream.txt 2>&1; echo "rc $?" >> $R/bench-stream.txt
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_memory.py -k "stream" > $R/gpu-stream.txt 2>&1; echo "rc $?" >> $R/gpu-stream.txt
timeout 80 python3 -m pytest -q -p no:cacheprovider -rs tests/ops/test_group_stats.py > $R/gpu-group-stats.txt 2>&1; echo "rc $?" >> $R/gpu-group-stats.txt
timeout 185 python3 -m bench.memory --out $R/mem --steps 20 > $R/bench-memory.txt 2>&1; echo "rc $?" >> $R/bench-memory.txt
cd $OUT && tar czf r.tgz r && rm -rf r
