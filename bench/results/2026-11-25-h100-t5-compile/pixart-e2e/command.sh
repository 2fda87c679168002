# Session 21, call A: T5 over the prompt's tokens and compiled under compile=True (patches/text_padding.py,
# COMPILED_TEXT_ENCODERS): the PixArt / text-padding / compile GPU tests, then PixArt-Σ 1024² end to end
# with both peer rows, in one process.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_pixart_patch.py tests/patches/test_text_padding.py "tests/patches/test_cuda_graph.py::test_compile_inside_the_graphs_matches_eager" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
tail -3 $R/gpu-tests.txt
timeout 420 python3 -m bench.dit --out $R/dit-pixart --model pixart-sigma --variants stock,stock+compile-graphs,stock+compile-graphs-unfused-qkv,patched+graph,patched+graph+compile > $R/bench-dit-pixart.txt 2>&1; echo "rc $?" >> $R/bench-dit-pixart.txt
cut -c1-400 $R/bench-dit-pixart.txt
cd $OUT && tar czf r.tgz r && rm -rf r
