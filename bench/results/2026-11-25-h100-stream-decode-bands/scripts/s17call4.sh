# Session 17, call 4 (H100): the planner holds 10 MiB back for cuDNN's workspace instead of 10% of the budget:
# bench.stream_decode --graph --profile, the GPU tests, the diagnostic at 10/8/12 MiB held back, the memory table.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 150 python3 -m bench.stream_decode --out $R/sd --graph --profile > $R/bench-stream.txt 2>&1; echo "rc $?" >> $R/bench-stream.txt
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_memory.py -k "stream" > $R/gpu-stream.txt 2>&1; echo "rc $?" >> $R/gpu-stream.txt
timeout 140 python3 -m bench.memory --out $R/mem --steps 20 > $R/bench-memory.txt 2>&1; echo "rc $?" >> $R/bench-memory.txt
timeout 150 python3 scratch/s17diag.py $R/diag > $R/diag.txt 2>&1; echo "rc $?" >> $R/diag.txt
cd $OUT && tar czf r.tgz r && rm -rf r
