# Session 18, call 1 (H100): biases folded (bias_residual, given-norm shift, interleave), first unit's input not
# double-counted, barred kept activations: GPU tests, bench.stream_decode --graph --profile, diagnostic.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_residual.py tests/ops/test_group_stats.py tests/test_memory.py -k "stream or residual or shift or vae_band" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 150 python3 -m bench.stream_decode --out $R/sd --graph --profile > $R/bench-stream.txt 2>&1; echo "rc $?" >> $R/bench-stream.txt
timeout 200 python3 scratch/s18diag.py $R/diag > $R/diag.txt 2>&1; echo "rc $?" >> $R/diag.txt
cd $OUT && tar czf r.tgz r && rm -rf r
