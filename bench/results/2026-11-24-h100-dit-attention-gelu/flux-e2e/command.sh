# Session 13, call 4: FLUX GPU tests; FLUX.1-dev (random weights, bf16) 1024² end to end against the peer.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 140 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_flux_patch.py tests/patches/test_pixart_patch.py -k "gpu" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 430 python3 -m bench.dit --out $R/dit-flux --model flux-dev --dtype bfloat16 --calls 2 --variants stock,patched+graph,stock+compile-graphs,patched+graph+compile+fused-qkv > $R/bench-dit-flux.txt 2>&1; echo "rc $?" >> $R/bench-dit-flux.txt
nvidia-smi --query-gpu=memory.used --format=csv >> $R/gpu.txt
cd $OUT && tar czf r.tgz r && rm -rf r
