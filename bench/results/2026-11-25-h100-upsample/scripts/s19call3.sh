# Session 19, call 3 (H100): SD1.5 end to end with the polyphase upsampler on by default (the peer at its best,
# patch(pipe), ours best), then the UNet step kernel for kernel, ours best with and without the upsample family
# (hopper vs hopper with upsample_conv2d disabled), one call.
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
timeout 330 python3 -m bench.e2e --out $R/e2e --models sd15@512 --variants stock+compile-graphs,patched+graph,patched+graph+compile+fused-qkv --no-ablation > $R/e2e.log 2>&1; echo "rc $?" >> $R/e2e.log
timeout 110 python3 -m bench.unet_kernels --out $R/k --setups patched-compile-fused-qkv > $R/uk.log 2>&1; echo "rc $?" >> $R/uk.log
SD_KERNELS_PROFILE=scratch/hopper-noup.json timeout 110 python3 -m bench.unet_kernels --out $R/k-noup --setups patched-compile-fused-qkv > $R/uk-noup.log 2>&1; echo "rc $?" >> $R/uk-noup.log
cd $OUT && tar czf r.tgz r && rm -rf r
