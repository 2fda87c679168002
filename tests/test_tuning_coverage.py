"""The shipped tuning tables cover the GroupNorm calls of the shipped SD models, as the Hopper patch
runs them: a table that misses a shape makes the first image autotune it (compiling every warp count
on the main thread), which is what kept SD1.5's first image at 17–22 s after the NHWC change of
2026-11-23 sent four more GroupNorm shapes down the pixel path (found 2026-11-24, docs/results.md).

Each model is built on the meta device (no memory) and patched with the ``hopper`` profile; one
forward at the resolution its tables were tuned for (bench/tune.py: batch 1 with CFG, so the UNet at
batch 2, the VAE decoder at batch 1; SDXL's pipeline decodes in fp32, ``force_upcast``, and the FP8
tier's copy of its decoder in bf16) records the
launcher key of every GroupNorm call, computed by ``group_norm`` itself, with its launchers replaced
by recorders. A meta-device conv returns NCHW whatever its operands; the fixture makes it return
channels_last when an operand is, as cuDNN does, so that every layout after it is the GPU's (this
emulation also shows that in SD2.1 and SDXL 29 of 61 and 19 of 46 GroupNorm inputs are NCHW: the
maps after each linear-projection Transformer2DModel, whose output diffusers makes NCHW-contiguous).
A change of layouts or plans therefore fails here until the tables are regenerated on the GPUs.
Attention's and the partial softmax's keys are not covered here.
"""

import importlib
import json

import pytest
import torch

import sd_kernels
from sd_kernels import models
from sd_kernels.runtime import autotune_cache

gn = importlib.import_module("sd_kernels.ops.group_norm")
TUNED = {"_STATS": gn._STATS, "_NORM": gn._NORM, "_TILE": gn._TILE, "_PIXEL_STATS": gn._PIXEL_STATS,
         "_PIXEL_NORM": gn._PIXEL_NORM}
DEVICES = ("nvidia-h100-80gb-hbm3-sm90", "nvidia-h200-sm90")
MODELS = (("sd15", 512), ("sd21", 768), ("sdxl", 1024))


def _table(device: str, launcher) -> set[str]:
    """The keys of the shipped table for ``launcher`` on ``device``, for every Triton version shipped
    (a key names shapes, plans and dtypes, not the Triton release: the CPU machine's Triton may differ).
    A device with no table of its own for the kernel takes the keys of the first table of another GPU of
    its architecture, as the nearest-key rule does at run time (autotune_cache.shipped_device_dirs: a
    key that table holds is its own nearest key, so nothing is timed)."""
    for folder in autotune_cache.device_dirs(autotune_cache.SHIPPED_ROOT / "hopper", device):
        paths = sorted(folder.glob(f"triton-*/{launcher.name}.json"))
        if paths:
            return set.intersection(*(set(json.loads(p.read_text())["entries"]) for p in paths))
    raise AssertionError(f"no shipped {launcher.name} table for {device} or another GPU of its architecture")


@pytest.fixture
def recorded(monkeypatch):
    """{launcher name: set of keys} that group_norm launches; nothing runs."""
    keys: dict[str, set[str]] = {name: set() for name in TUNED}

    def recorder(name):
        return lambda key, grid, *args, **kwargs: keys[name].add(repr(key))

    for name in TUNED:
        monkeypatch.setattr(gn, name, recorder(name))
    monkeypatch.setattr(gn, "_PIXEL_MERGE", lambda *args, **kwargs: None)  # not autotuned
    monkeypatch.setattr(gn, "use_kernel", lambda *args, **kwargs: True)
    # cuDNN gives a conv channels_last output when its input or weight is channels_last; the meta
    # device's conv does not: do it as the GPU does, so that the layouts after it are the GPU's.
    conv = torch.nn.functional.conv2d

    def like_cudnn(x, w, *args, **kwargs):
        y = conv(x, w, *args, **kwargs)
        return y.contiguous(memory_format=torch.channels_last) if any(map(_nhwc, (x, w))) else y

    monkeypatch.setattr(torch.nn.functional, "conv2d", like_cudnn)
    return keys


def _nhwc(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _run(name: str, size: int) -> None:
    from bench.e2e import unet_inputs

    cfg = models.load_config(name)
    side = size // 8
    with torch.no_grad():
        unet = models.build_model(name, "unet", device="meta", dtype=torch.float16)
        sd_kernels.patch(unet, profile="hopper", cuda_graph=False)
        x, ctx, kwargs = unet_inputs(cfg["unet"], 2, side, "meta", torch.float16, None, size)
        unet(x, torch.zeros(2, device="meta"), ctx, **kwargs)
        # SDXL's pipeline decodes in fp32 (force_upcast), and the FP8 tier's copy of its decoder in bf16
        upcast = cfg["vae"].get("force_upcast") and name == "sdxl"
        for dtype in (torch.float32, torch.bfloat16) if upcast else (torch.float16,):
            vae = models.build_model(name, "vae", device="meta", dtype=dtype)
            sd_kernels.patch(vae, profile="hopper", cuda_graph=False)
            vae.decode(torch.zeros(1, vae.config.latent_channels, side, side, device="meta", dtype=dtype))


@pytest.mark.integration
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, size", MODELS)
def test_shipped_tables_cover_every_group_norm_of_the_sd_models(name, size, device, recorded):
    _run(name, size)
    assert sum(map(len, recorded.values())) >= 10  # the recorders saw the calls
    # A launcher these models never call (the split path's statistics, since the UNet and VAE run
    # channels_last on Hopper) needs no table.
    missing = {launcher: sorted(keys - _table(device, TUNED[launcher])) for launcher, keys in recorded.items() if keys}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, f"{name}@{size}: keys no shipped table on {device} holds (run python -m bench.tune): {missing}"
