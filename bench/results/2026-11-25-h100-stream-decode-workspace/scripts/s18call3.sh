# Session 18, call 3 (H100): no whole-module segment inside a banded plan: GPU tests, bench.stream_decode, the memory table.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_residual.py tests/ops/test_group_stats.py tests/test_memory.py -k "stream or residual or shift or vae_band" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 120 python3 -m bench.stream_decode --out $R/sd --graph --profile > $R/bench-stream.txt 2>&1; echo "rc $?" >> $R/bench-stream.txt
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_memory.py -k "streamed_within" > $R/gpu-tests-again.txt 2>&1; echo "rc $?" >> $R/gpu-tests-again.txt
timeout 140 python3 -m bench.memory --out $R/mem --steps 20 > $R/bench-memory.txt 2>&1; echo "rc $?" >> $R/bench-memory.txt
cd $OUT && tar czf r.tgz r && rm -rf r
