"""ControlNet pipelines (patches/families.py: ControlNetModel, MultiControlNetModel): the ControlNet
model(s) are patched with the UNet and the VAE, outputs stay within the kernels' tolerance of stock,
unpatch is exact, ``ignore=("controlnet",)`` leaves them alone."""

import pytest
import torch

import sd_kernels
from sd_kernels import models


def _run(pipe, steps=2):
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    cond = [image] * 2 if type(pipe.controlnet).__name__ == "MultiControlNetModel" else image
    with torch.no_grad():
        return pipe(prompt="a cat", image=cond, num_inference_steps=steps, height=64, width=64,
                    output_type="pt", generator=torch.Generator().manual_seed(0)).images


def _processors(model):
    return [type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")]


@pytest.mark.parametrize("controlnets", [1, 2])
def test_controlnets_are_patched_and_unpatched_exactly(controlnets, monkeypatch):
    # the ops' reference backend: this is about which modules are patched (the kernels have their
    # own tests; the interpreter would take minutes on two pipelines)
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    pipe = models.build_controlnet_pipeline("tiny", controlnets=controlnets)
    pipe.set_progress_bar_config(disable=True)
    stock = _run(pipe)
    params = dict(pipe.controlnet.state_dict(keep_vars=True))
    with sd_kernels.patched(pipe, cuda_graph=False) as record:
        assert record.parts == ["unet", "vae", "controlnet"]
        assert set(_processors(pipe.controlnet)) == {"SDKernelsAttnProcessor"}
        norms = [type(m).__name__ for m in pipe.controlnet.modules() if isinstance(m, torch.nn.GroupNorm)]
        assert norms and set(norms) == {"FusedGroupNorm"}
        ours = _run(pipe)
    torch.testing.assert_close(ours, stock, rtol=2e-3, atol=2e-3)
    assert set(_processors(pipe.controlnet)) == {"AttnProcessor2_0"}
    after = pipe.controlnet.state_dict(keep_vars=True)
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    assert torch.equal(_run(pipe), stock)


def test_ignore_leaves_the_controlnet_alone():
    pipe = models.build_controlnet_pipeline("tiny")
    with sd_kernels.patched(pipe, cuda_graph=False, ignore=("controlnet",)) as record:
        assert "controlnet" not in record.parts
        assert set(_processors(pipe.controlnet)) == {"AttnProcessor2_0"}


@pytest.mark.gpu
def test_gpu_sd15_controlnet_pipeline_patched_and_graphed():
    """SD1.5 + ControlNet 512² (random weights, fp16, 8 steps): ``patch(pipe)`` (graphs, the ControlNet
    call among them) against the stock pipeline: PSNR ≥ 40 dB, the fidelity bar; unpatch exact."""
    from sd_kernels.testing import psnr

    pipe = models.build_controlnet_pipeline("sd15", device="cuda", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 512, 512, generator=torch.Generator().manual_seed(5))

    def run():
        with torch.no_grad():
            return pipe(prompt="a cat", image=image, num_inference_steps=8, output_type="pt",
                        generator=torch.Generator(device="cuda").manual_seed(0)).images.float()

    stock = run()
    record = sd_kernels.patch(pipe)
    assert "controlnet" in record.parts and record.cuda_graph == "pipeline"
    ours, again = run(), run()  # capture, then replay
    sd_kernels.unpatch(pipe)
    assert psnr(ours, stock) >= 40 and psnr(again, stock) >= 40
    assert torch.equal(run(), stock)
