# Session 19, call 4 (H100): bias_residual's per-op benchmark; the streamed decode again (its upsampler table now
# against diffusers' interpolate + conv, not the patched module); the VAE decode replayed, stock / patched /
# patched without the upsample family / stock compiled, SD1.5 512² and SDXL 1024²; the upsample patch's GPU test.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
timeout 110 python3 -m bench.run --out $R/ops --only residual > $R/ops.log 2>&1; echo "rc $?" >> $R/ops.log
timeout 130 python3 scratch/vae_ab.py $R > $R/vae_ab.log 2>&1; echo "rc $?" >> $R/vae_ab.log
timeout 90 python3 -m bench.stream_decode --out $R/sd --graph > $R/stream.log 2>&1; echo "rc $?" >> $R/stream.log
SD_KERNELS_AUTOTUNE=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/patches/test_upsample_patch.py > $R/gpu-tests-patch.txt 2>&1; echo "rc $?" >> $R/gpu-tests-patch.txt
cd $OUT && tar czf r.tgz r && rm -rf r
