# Session 19, call 5 (H100): SDXL 1024² end to end with the polyphase upsampler on by default: the peer at its best
# and ours best, one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 560 python3 -m bench.e2e --out $R/e2e --models sdxl@1024 --variants stock+compile-graphs,patched+graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
