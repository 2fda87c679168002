# Session 19, call 2 (H100): after call 1's fixes (polyphase_min_pixels 256 in the profiles: the 8² UNet upsampler
# stays stock; bench fixes: bias_residual's argument order, dynamo reset per case; the streamed decode accepts the
# patched upsampler class). Per-op benchmarks, the streamed decode vs the untiled decode (now polyphase),
# the upsample patch's GPU test (UNet replayed and compiled) and the pipeline fidelity GPU tests.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 180 python3 -m bench.run --out $R/ops --only upsample,residual > $R/ops.log 2>&1; echo "rc $?" >> $R/ops.log
timeout 100 python3 -m bench.stream_decode --out $R/sd --graph > $R/stream.log 2>&1; echo "rc $?" >> $R/stream.log
SD_KERNELS_AUTOTUNE=0 timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_upsample_patch.py > $R/gpu-tests-patch.txt 2>&1; echo "rc $?" >> $R/gpu-tests-patch.txt
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -s tests/test_fidelity.py > $R/gpu-tests-fidelity.txt 2>&1; echo "rc $?" >> $R/gpu-tests-fidelity.txt
cd $OUT && tar czf r.tgz r && rm -rf r
