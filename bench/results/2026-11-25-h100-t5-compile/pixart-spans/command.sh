# Session 21, call B: the GPU tests of T5 over the prompt's tokens (verbose, room for inductor's compiles),
# then where a PixArt-Σ 1024² call's time goes with the T5 cut and compiled (CUDA-event spans).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
SD_KERNELS_AUTOTUNE=0 timeout 330 python3 -m pytest -m gpu -v -p no:cacheprovider -rs --durations=0 tests/patches/test_pixart_patch.py tests/patches/test_text_padding.py "tests/patches/test_cuda_graph.py::test_compile_inside_the_graphs_matches_eager" > $R/gpu-tests.txt 2>&1; echo "rc $?" >> $R/gpu-tests.txt
grep -E "PASS|FAIL|ERROR|rc " $R/gpu-tests.txt | tail -12
timeout 250 python3 scratch/pixart_spans.py $R patched+graph+compile,patched+graph > $R/spans.txt 2>&1; echo "rc $?" >> $R/spans.txt
grep -v Warning $R/spans.txt | tail -4
cd $OUT && tar czf r.tgz r && rm -rf r
