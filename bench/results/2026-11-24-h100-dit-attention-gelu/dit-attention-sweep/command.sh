# Session 13, call 1: the DiT attention sweep, the unrun SD3/PixArt GPU tests, SD3-medium against the peer.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, triton.__version__, diffusers.__version__, transformers.__version__)" >> $R/gpu.txt
timeout 140 python3 -m bench.ops_attention $R/sweep --dit > $R/sweep.txt 2>&1; echo "rc $?" >> $R/sweep.txt
SD_KERNELS_AUTOTUNE=0 timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_sd3_patch.py tests/patches/test_pixart_patch.py > $R/gpu-tests-dit.txt 2>&1; echo "rc $?" >> $R/gpu-tests-dit.txt
timeout 300 python3 -m bench.dit --out $R/dit --model sd3-medium --steps 20 > $R/bench-dit-sd3.txt 2>&1; echo "rc $?" >> $R/bench-dit-sd3.txt
cd $OUT && tar czf r.tgz r && rm -rf r
