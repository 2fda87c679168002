# Session 15, call 5 (H100, H100 tables of call 4 in the tree): GroupNorm shift GPU tests, the fold A/B kernel for kernel
# (ours with and without the ResnetBlock2D bias + temb fold, one call), SD1.5 end to end (peer, patch(pipe), ours best).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
SD_KERNELS_AUTOTUNE=0 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_group_norm.py -k "shift or launch_count" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 100 python3 -m bench.unet_kernels --out $R/k --setups patched-compile-fused-qkv > $R/uk.log 2>&1; echo "rc $?" >> $R/uk.log
timeout 100 python3 scratch/nofold.py --out $R/k-nofold --setups patched-compile-fused-qkv > $R/uk-nofold.log 2>&1; echo "rc $?" >> $R/uk-nofold.log
timeout 330 python3 -m bench.e2e --out $R/e2e --models sd15@512 --variants stock+compile-graphs,patched+graph,patched+graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
cd $OUT && tar czf r.tgz r && rm -rf r
