"""FLUX's q, k, v projections as one GEMM on a buffer their weights share (patches/qkv_fusion.py): with
the reference ops the patched transformer computes stock's bits; whatever changes a projection while
patched (a Parameter assigned anew, a wrapped Linear, a dtype change) sends the call back to separate
projections, and an in-place update through a view reaches the fused GEMM; unpatch leaves the weights
as those changes left them; the patches that fuse nothing say why."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from diffusers.hooks import HookRegistry, ModelHook
from sd_kernels.patches import qkv_fusion
from test_flux_patch import _inputs, _run, transformer  # noqa: F401  (transformer: a fixture)

import sd_kernels


@pytest.fixture
def reference(monkeypatch):
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")


class _Sub(torch.Tensor):
    pass


class _Doubled(ModelHook):
    def post_forward(self, module, output):
        return output * 2


class _Wrapped(nn.Module):
    """A Linear wrapped as a LoRA layer wraps it: the same output, another module."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.base_layer = inner

    def forward(self, x):
        return self.base_layer(x)


def _change(model, how: str) -> None:
    """One change to the first double-stream block's projections (as a user or a library makes it)."""
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if how == "new parameter":
            attn.to_k.weight = nn.Parameter(torch.randn(attn.to_k.weight.shape, generator=g))
        elif how == "data assigned":
            attn.add_v_proj.weight.data = torch.randn(attn.add_v_proj.weight.shape, generator=g)
        elif how == "in place":
            attn.to_v.weight.mul_(1.5)
            attn.add_q_proj.bias.add_(0.25)
        elif how == "wrapped":
            attn.to_q = _Wrapped(attn.to_q)
        elif how == "hooked":
            attn.to_k.register_forward_hook(lambda module, args, out: out * 2)
        elif how == "diffusers hook":
            HookRegistry.check_if_exists_or_initialize(attn.to_v).register_hook(_Doubled(), "doubled")
        elif how == "instance forward":
            attn.to_q.forward = lambda x, linear=attn.to_q: nn.Linear.forward(linear, x) * 2
        elif how == "subclass":  # a weight of another tensor type (as a quantizer's): never asked for storage
            attn.to_k.weight = nn.Parameter(attn.to_k.weight.detach().clone().as_subclass(_Sub))


@pytest.mark.parametrize("how", ["new parameter", "data assigned", "in place", "wrapped", "hooked", "diffusers hook",
                                 "instance forward", "subclass"])
def test_a_projection_changed_while_patched_is_computed_as_changed(transformer, reference, how):  # noqa: F811
    x, kw = _inputs(transformer)
    stock = copy.deepcopy(transformer)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["qkv_fusion"] == 6
        _change(transformer, how)
        _change(stock, how)
        want = _run(stock, x, kw)
        assert torch.equal(_run(transformer, x, kw), want)
        attn = transformer.transformer_blocks[0].attn
        with torch.no_grad():
            served = attn.processor.qkv.operands(attn, qkv_fusion.STREAMS[0][1]) is not None
        assert served is (how in ("in place", "data assigned"))  # the image stream's; "data assigned" is the text's
    assert torch.equal(_run(transformer, x, kw), want)  # unpatched: the weights as the change left them
    for a in transformer.modules():  # and each in storage of its own, whatever became of the others
        for p in (a.parameters(recurse=False) if isinstance(a, nn.Linear) else ()):
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


def test_a_dtype_change_while_patched_falls_back_and_unpatches_as_changed(transformer, reference):  # noqa: F811
    x, kw = _inputs(transformer)
    stock = copy.deepcopy(transformer).double()
    want = _run(stock, x, kw, torch.float64)
    with sd_kernels.patched(transformer, cuda_graph=False):
        transformer.double()
        attn = transformer.transformer_blocks[0].attn
        assert attn.processor.qkv.operands(attn, qkv_fusion.STREAMS[0][1]) is None
        # (the same 4e-9 without the fusion: other ops of the patch round some intermediates to fp32)
        torch.testing.assert_close(_run(transformer, x, kw, torch.float64), want, rtol=0, atol=1e-7)
    assert all(a.to_q.weight.dtype == torch.float64 for a in transformer.modules() if hasattr(a, "to_q"))
    assert torch.equal(_run(transformer, x, kw, torch.float64), want)


@pytest.mark.integration
def test_fused_and_separate_calls_agree_on_the_kernels(transformer):  # noqa: F811
    """On the kernels (the interpreter here), the fused GEMM's q, k, v feed the same attention as three
    GEMMs would: the outputs agree to fp32 rounding."""
    x, kw = _inputs(transformer)
    with sd_kernels.patched(transformer, cuda_graph=False):
        fused = _run(transformer, x, kw)
        for a in transformer.modules():
            for stream in (getattr(getattr(a, "processor", None), n, None) for n in ("qkv", "added_qkv")):
                if stream is not None:
                    stream.operands = lambda *args: None  # separate projections
        separate = _run(transformer, x, kw)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting, reason", [
    ({"compile": "default"}, "compile=True"),
    ({"memory_plan": object()}, "memory budget"),
])
def test_patches_that_fuse_nothing_say_why(setting, reason):
    record = dataclasses.make_dataclass("Record", [("precision", object, None), ("compile", object, None),
                                                   ("memory_plan", object, None)])(**setting)
    assert reason in qkv_fusion.wanted(record)
    assert qkv_fusion.wanted(dataclasses.replace(record, **{k: None for k in setting})) is None


def test_a_module_fused_by_diffusers_is_left_to_its_to_qkv(transformer):  # noqa: F811
    transformer.fuse_qkv_projections()
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert "qkv_fusion" not in record.counts
        assert all(a.processor.qkv is None for a in transformer.modules() if hasattr(a, "fused_projections"))


def test_unfit_projections_are_skipped_with_the_reason(transformer):  # noqa: F811
    attn = transformer.single_transformer_blocks[0].attn
    attn.to_v = _Wrapped(attn.to_v)
    with sd_kernels.patched(transformer, cuda_graph=False) as record:
        assert record.counts["qkv_fusion"] == 5
        assert any("q, k, v not fused: not exactly nn.Linear" in s.reason for s in record.skipped)


def test_only_the_parameters_hold_the_shared_storage_and_gradients_take_separate_projections(transformer):  # noqa: F811
    """Weights moved or offloaded free the storage they shared (nothing else refers to it); a call that
    wants gradients for the projections takes them separately (autograd would not reach the Parameters
    through the fused operands)."""
    with sd_kernels.patched(transformer, cuda_graph=False):
        attn = transformer.transformer_blocks[0].attn
        fused = attn.processor.qkv
        assert not any(isinstance(v, torch.Tensor) for v in vars(fused).values())
        with torch.no_grad():
            assert fused.operands(attn, qkv_fusion.STREAMS[0][1]) is not None
        with torch.enable_grad():  # with or without Parameters that want gradients: an input may
            assert fused.operands(attn, qkv_fusion.STREAMS[0][1]) is None
        with torch.inference_mode():
            assert fused.operands(attn, qkv_fusion.STREAMS[0][1]) is not None


def test_a_patch_under_inference_mode_leaves_normal_parameters(transformer):  # noqa: F811
    """Patched and unpatched inside inference mode (as benchmarks do), the re-laid Parameters stay normal
    tensors: autograd can use the model afterwards."""
    with torch.inference_mode():
        record = sd_kernels.patch(transformer, cuda_graph=False)
        assert record.counts["qkv_fusion"] == 6
    assert not any(p.is_inference() for p in transformer.parameters())
    with torch.inference_mode():
        sd_kernels.unpatch(transformer)
    assert not any(p.is_inference() for p in transformer.parameters())
    x, kw = _inputs(transformer)
    x.requires_grad_(True)  # the backward to the latents saves the weights: inference tensors would refuse
    transformer(x, **kw, return_dict=False)[0].sum().backward()
    assert x.grad is not None


def test_the_fp8_tier_fuses_the_quantized_projections(transformer):  # noqa: F811
    """The FP8 tier keeps the layout and serves each stream from its codes laid out alike (patches/fp8.py,
    tests/patches/test_fp8_patch.py); unpatch gives each Parameter storage of its own again."""
    with sd_kernels.patched(transformer, cuda_graph=False, precision="fp8") as record:
        assert record.counts["flux_attention_processor"] == 4
        assert record.counts["qkv_fusion"] == record.counts["fp8.qkv"] == 6
    weights = [a.to_q.weight for a in transformer.modules() if hasattr(a, "to_q")]
    assert all(w.untyped_storage().nbytes() == w.numel() * w.element_size() for w in weights)


def test_projections_a_stream_does_not_serve_run_in_diffusers_order(transformer):  # noqa: F811
    """Where the fusion does not serve (here: forward hooks on the projections), the projections run one by
    one in diffusers' order, the image stream's before the text stream's: hooks see the calls stock makes."""
    attn = transformer.transformer_blocks[0].attn
    names = [*qkv_fusion.STREAMS[0][1], *qkv_fusion.STREAMS[1][1]]

    def calls():
        seen = []
        handles = [getattr(attn, n).register_forward_hook(lambda m, a, o, n=n: seen.append(n)) for n in names]
        _run(transformer, *_inputs(transformer))
        for h in handles:
            h.remove()
        return seen

    stock = calls()
    with sd_kernels.patched(transformer, cuda_graph=False):
        patched = calls()
    assert stock == patched == names


def test_a_copy_or_pickle_of_the_layout_is_refused_not_a_crash(transformer):  # noqa: F811
    """A patched model's deep copy or pickle stops at the layout's weak references to its storages with the
    record's refusal: copied, a ``StorageWeakRef`` would free its weak reference twice (the process crashed)."""
    import pickle

    with sd_kernels.patched(transformer, cuda_graph=False):
        fused = transformer.transformer_blocks[0].attn.processor.qkv
        for act in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=r"sd_kernels.unpatch\(obj\) first"):
                act(fused.storages)
            with pytest.raises(TypeError, match=r"sd_kernels.unpatch\(obj\) first"):
                act(transformer)


@pytest.mark.parametrize("precision", [None, "fp8"])
def test_a_model_built_under_inference_mode_is_fused_runs_and_unpatches_exactly(precision, reference):
    """Weights made under ``torch.inference_mode`` (as benchmarks build their pipelines) are laid out as inference
    tensors too: the patch's version checks read none (a normal tensor's data under an inference Parameter had
    one that could not be read), the UNet's fused self-attentions run (the reference ops: the plumbing is under
    test), and unpatch gives back the same values, still inference tensors."""
    from sd_kernels.models import build_pipeline

    with torch.inference_mode():
        pipe = build_pipeline("tiny")
        pipe.set_progress_bar_config(disable=True)
        state = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
        record = sd_kernels.patch(pipe, precision=precision, cuda_graph=False)
        assert record.counts["qkv_fusion"] > 0
        latents = pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="latent").images
        assert torch.isfinite(latents).all()
        sd_kernels.unpatch(pipe)
        after = pipe.unet.state_dict()
        assert all(torch.equal(after[k], v) for k, v in state.items())
        assert all(p.is_inference() for p in pipe.unet.parameters())
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in pipe.unet.parameters())
