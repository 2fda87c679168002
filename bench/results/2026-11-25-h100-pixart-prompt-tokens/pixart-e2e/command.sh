# Session 20, call 3: PixArt's cross-attention over the prompt's tokens (patches/text_padding.py):
# the PixArt GPU tests, then PixArt-Σ 1024² end to end with both peer rows, in one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_pixart_patch.py > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
timeout 455 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,stock+compile-graphs,stock+compile-graphs-unfused-qkv,patched+graph+compile+fused-qkv,patched+graph,patched+graph+compile > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
tail -3 $R/gpu-tests.txt; cut -c1-400 $R/bench-dit-pixart.txt
cd $OUT && tar czf r.tgz r && rm -rf r
