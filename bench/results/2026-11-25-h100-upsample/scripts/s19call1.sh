# Session 19, call 1 (H100): the polyphase upsampler (ops.upsample_conv2d, patch family "upsample") and bias_residual:
# GPU tests (ops, the UNet replayed/compiled, pipeline fidelity), per-op benchmarks vs stock and torch.compile,
# the SD1.5 UNet step kernel for kernel (peer, ours, ours without the upsampler), the streamed decode's ratios
# against the untiled decode (which now runs the polyphase upsampler).
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.version.cuda)" >> $R/gpu.txt 2>&1
python3 - <<'PY'
import json
p = json.load(open("sd_kernels/profiles/hopper.json"))
p["name"] = "hopper-noup"; p["disabled_ops"] = sorted(set(p.get("disabled_ops", [])) | {"upsample_conv2d"})
json.dump(p, open("scratch/hopper-noup.json", "w"), indent=1)
PY
SD_KERNELS_AUTOTUNE=0 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_upsample.py tests/ops/test_residual.py > $R/gpu-tests-ops.txt 2>&1; echo "rc $?" >> $R/gpu-tests-ops.txt
timeout 170 python3 -m bench.run --out $R/ops --only upsample,residual > $R/ops.log 2>&1; echo "rc $?" >> $R/ops.log
timeout 130 python3 -m bench.unet_kernels --out $R/k --setups peer,patched-compile-fused-qkv > $R/uk.log 2>&1; echo "rc $?" >> $R/uk.log
SD_KERNELS_PROFILE=scratch/hopper-noup.json timeout 70 python3 -m bench.unet_kernels --out $R/k-noup --setups patched-compile-fused-qkv > $R/uk-noup.log 2>&1; echo "rc $?" >> $R/uk-noup.log
timeout 80 python3 -m bench.stream_decode --out $R/sd --graph > $R/stream.log 2>&1; echo "rc $?" >> $R/stream.log
cd $OUT && tar czf r.tgz r && rm -rf r
