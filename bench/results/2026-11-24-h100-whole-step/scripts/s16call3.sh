# Session 16, call 3 (H100): whole-step graphs after two fixes (noise buffers made outside the graph's pool; inference
# tensors copied in every step): their GPU tests, the pipeline mode's GPU tests (GraphedCall refactored), then SD1.5 end
# to end: the peer, ours best (pipeline graphs), ours best with whole-step graphs, one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider -rs tests/patches/test_whole_step.py > $R/gpu-whole-step.txt 2>&1; echo "rc $?" >> $R/gpu-whole-step.txt
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_cuda_graph.py -k "not compile" > $R/gpu-cuda-graph.txt 2>&1; echo "rc $?" >> $R/gpu-cuda-graph.txt
timeout 330 python3 -m bench.e2e --out $R/e2e --models sd15@512 --variants stock+compile-graphs,patched+graph+compile+fused-qkv,patched+step-graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
