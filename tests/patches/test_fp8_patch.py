"""``patch(pipe, precision="fp8")``: the switch, its refusals, the record, the image it gives on the
tiny pipelines, and an unpatch that gives back the very modules and Parameters. Unmarked tests run
the tiny pipelines on the CPU through the interpreter (the patch refuses the CPU otherwise)."""

import collections
import importlib
import types

import pytest
import torch
import torch.nn as nn
from dit_checks import cpu_only
from sd_kernels.patches import fp8, modulation_split
from sd_kernels.patches.attention import PRECISION_PROCESSORS
from test_flux_patch import _inputs as flux_inputs
from test_sd3_patch import _inputs as sd3_inputs

import sd_kernels
from sd_kernels.models import build_pipeline, load_config
from sd_kernels.testing import psnr, rel_err

attention_op = importlib.import_module("sd_kernels.ops.attention")
attention_fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")
fp8_ops = importlib.import_module("sd_kernels.ops.fp8_linear")


def _denoiser(pipe):
    return pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.unet


def _run(pipe, output_type="pt"):
    g = torch.Generator(pipe.device).manual_seed(0)
    kwargs = {"clean_caption": False} if type(pipe).__name__.startswith("PixArt") else {}
    return pipe("a cat", num_inference_steps=1, height=64, width=64, generator=g, output_type=output_type,
                return_dict=False, **kwargs)[0]


@pytest.fixture(scope="module")
def flux():
    pipe = build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@cpu_only
@pytest.mark.parametrize("name,families", [
    ("tiny-flux", {"fp8.attention", "fp8.feed_forward", "fp8.modulation", "fp8.projection", "fp8.FeedForward",
                   "fp8.AdaLayerNormZero"}),
    ("tiny-sd3", {"fp8.attention", "fp8.feed_forward", "fp8.modulation", "fp8.FeedForward", "fp8.AdaLayerNormZero"}),
    ("tiny-pixart", {"fp8.attention", "fp8.feed_forward", "fp8.FeedForward"}),
    ("tiny", {"fp8.attention", "fp8.feed_forward", "fp8.FeedForward", "fp8.LayerNorm"}),
])
@pytest.mark.integration
def test_fp8_image_close_to_stock_and_unpatch_exact(name, families):
    _image_close_and_unpatch_exact(build_pipeline(name), families)


@pytest.mark.gpu
@pytest.mark.parametrize("torch_gemm", [True, False], ids=["as-dispatched", "triton-gemms-only"])
def test_gpu_fp8_flux_in_bfloat16(monkeypatch, count_calls, torch_gemm):
    """The same on the GPU: tiny FLUX in bf16 through the compiled FP8 kernels, eager and graphed; as
    dispatched (on Hopper its bf16 GEMMs of at least 64 rows on torch's ``_scaled_mm``) and with every GEMM
    on our Triton kernels (their fused gate and residual epilogue in the blocks)."""
    fp8_ops = importlib.import_module("sd_kernels.ops.fp8_linear")
    monkeypatch.setattr(fp8_ops, "TORCH_GEMM", torch_gemm)
    served = count_calls(fp8_ops, torch_gemm="_torch_gemm")
    families = {"fp8.attention", "fp8.feed_forward", "fp8.FeedForward", "fp8.AdaLayerNormZero"}
    _image_close_and_unpatch_exact(build_pipeline("tiny-flux", "cuda", torch.bfloat16), families, images=True)
    _image_close_and_unpatch_exact(build_pipeline("tiny-flux", "cuda", torch.bfloat16), families, cuda_graph=True,
                                   images=True)
    # with every op family: the blocks' fused forwards take the tier's join and gated residuals, and each
    # attention's q, k, v are one FP8 GEMM a stream
    _image_close_and_unpatch_exact(build_pipeline("tiny-flux", "cuda", torch.bfloat16),
                                   families | {"qkv_fusion", "fp8.qkv"}, cuda_graph=True, images=True, ops=None)
    # tiny FLUX's projections have 64 image and 512 text rows: torch's GEMM serves them where it runs
    assert bool(served["torch_gemm"]) == (torch_gemm and fp8_ops._torch_gemm_device(torch.device("cuda")))


def _image_close_and_unpatch_exact(pipe, families, cuda_graph=False, images=False, ops=()):
    """The tier's latents close to stock's (and its images, with ``images``: on CPU the latents alone,
    since the tier changes nothing outside the transformer blocks and the VAE decodes as stock), the
    record, and an exact unpatch."""
    pipe.set_progress_bar_config(disable=True)
    model = _denoiser(pipe)
    stock_latent = _run(pipe, "latent")
    stock_image = _run(pipe) if images else None
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}

    record = sd_kernels.patch(pipe, precision="fp8", ops=None if ops is None else list(ops), cuda_graph=cuda_graph)
    assert families <= set(record.counts), record.counts
    assert record.precision == "fp8" and "fp8:" in record.format() and "exact unpatch" in record.format()
    assert model.state_dict().keys() == state.keys()  # the same keys (and Parameters) while patched
    latent = _run(pipe, "latent")
    assert not torch.equal(latent, stock_latent)  # it did change the computation
    assert rel_err(latent, stock_latent) < 0.1, rel_err(latent, stock_latent)
    if stock_image is not None:
        assert psnr(_run(pipe), stock_image) > 30

    assert sd_kernels.unpatch(pipe)
    assert all(dict(model.named_modules())[k] is m for k, m in modules.items())
    assert all(dict(model.named_parameters())[k] is p for k, p in params.items())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert torch.equal(_run(pipe, "latent"), stock_latent)


@cpu_only
def test_precision_is_validated_before_any_change(flux):
    with pytest.raises(ValueError, match=r"precision='int8': choose one of \('fp16', 'fp8'\)"):
        sd_kernels.patch(flux, precision="int8")
    assert sd_kernels.patches.patch_record(flux) is None
    record = sd_kernels.patch(flux, precision="fp16", ops=[], cuda_graph=False)  # the lossless default by name
    try:
        assert record.precision is None and not any(k.startswith("fp8") for k in record.counts)
    finally:
        sd_kernels.unpatch(flux)


def test_a_gpu_without_fp8_is_refused(monkeypatch):
    class OnA100(nn.Module):
        def parameters(self, recurse=True):
            yield types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"compute capability 8.9 or later.*A100 \(sm_80\)"):
        fp8.check_models([("transformer", OnA100())])


@cpu_only
def test_the_cpu_without_the_interpreter_is_refused(flux, monkeypatch):
    monkeypatch.setattr(fp8, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        sd_kernels.patch(flux, precision="fp8")
    assert sd_kernels.patches.patch_record(flux) is None


@cpu_only
def test_same_request_changes_nothing_and_another_repatches(flux):
    record = sd_kernels.patch(flux, precision="fp8", ops=[], cuda_graph=False)
    try:
        assert sd_kernels.patch(flux, precision="fp8", ops=[], cuda_graph=False) is record
        lossless = sd_kernels.patch(flux, ops=[], cuda_graph=False)
        assert lossless is not record and not any(k.startswith("fp8") for k in lossless.counts)
        assert not any(isinstance(m, fp8.Fp8Linear) for m in flux.transformer.modules())
    finally:
        sd_kernels.unpatch(flux)


@cpu_only
@pytest.mark.parametrize("cross_kv_fp8", [False, True], ids=["cross-kv-kept", "cross-kv-fp8"])
def test_unet_self_attention_is_one_fp8_gemm_and_the_text_projections_stay_exact(cross_kv_fp8, monkeypatch):
    """In a UNet's blocks each self-attention's q, k and v are one FP8 GEMM (their weights laid out as one by
    patches/qkv_fusion.py); a cross-attention's key and value projections, which read the text, stay the
    model's own ``nn.Linear`` unless ``CROSS_KV_FP8`` asks for FP8, and the record says how many stayed."""
    monkeypatch.setattr(fp8, "CROSS_KV_FP8", cross_kv_fp8)
    pipe = build_pipeline("tiny")
    unet = pipe.unet
    attentions = [m for m in unet.modules() if hasattr(m, "is_cross_attention") and hasattr(m, "to_k")]
    crosses = [a for a in attentions if a.is_cross_attention]
    assert crosses and len(crosses) < len(attentions)
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    try:
        # (qkv_fusion also counts the VAE's self-attentions, which stay exact)
        assert record.counts["fp8.qkv"] == len(attentions) - len(crosses) < record.counts["qkv_fusion"]
        kinds = {type(a.to_k) for a in crosses} | {type(a.to_v) for a in crosses}
        assert kinds == ({fp8.Fp8Linear} if cross_kv_fp8 else {nn.Linear})
        assert all(type(a.to_q) is fp8.Fp8Linear for a in attentions)
        kept = f"{2 * len(crosses)} cross-attention key/value projections"
        assert (kept in record.format()) != cross_kv_fp8
    finally:
        sd_kernels.unpatch(pipe)
    assert all(type(a.to_k) is nn.Linear for a in attentions)


@pytest.mark.integration
@cpu_only
def test_unet_block_norms_write_the_codes_their_projections_read(count_calls, monkeypatch):
    """A UNet block's norm1, norm2 and norm3 write their outputs' FP8 codes (``Fp8LayerNorm``): the projections
    after them (q, k, v; the cross-attention's q; the feed-forward's first GEMM) quantize nothing of their own,
    three quantizations fewer a block, and the latents stay close to those of norms that do not."""
    pipe = build_pipeline("tiny")
    pipe.set_progress_bar_config(disable=True)
    blocks = sum(type(m).__name__ == "BasicTransformerBlock" for m in pipe.unet.modules())
    quantized = count_calls(fp8_ops, quantize="quantize_rows")
    runs = {}
    for codes in (True, False):
        if not codes:
            monkeypatch.setattr(fp8, "_unet_norm", lambda *args: False)
        with sd_kernels.patched(pipe, precision="fp8", ops=[], cuda_graph=False) as record:  # the tier alone
            assert record.counts.get("fp8.LayerNorm", 0) == (3 * blocks if codes else 0)
            before = quantized["quantize"]
            runs[codes] = _run(pipe, "latent"), quantized["quantize"] - before
    assert runs[False][1] - runs[True][1] == 3 * blocks  # one step: the UNet called once, on the guided batch
    assert rel_err(runs[True][0], runs[False][0]) < 1e-2


@pytest.fixture
def park_from_the_cpu(monkeypatch):
    """``Fp8Linear.offload`` parks nothing whose codes are on the CPU (nothing to free); here it runs the parking
    path all the same, a copy within the CPU's memory, as from a GPU."""
    monkeypatch.setattr(fp8, "_PARK_FROM_THE_CPU", True)


@pytest.mark.integration
@cpu_only
def test_offloaded_originals_change_no_result_and_unpatch_brings_them_back_exactly(park_from_the_cpu):
    """``offload_originals`` moves each FP8 layer's original weight to storage of its own in the CPU's memory
    and leaves the codes as they were: the same latents; ``unpatch`` gives back the very Parameters, bit for
    bit, and stock's latents."""
    pipe = build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer
    stock = _run(pipe, "latent")
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="precision='fp8' first"):
        sd_kernels.offload_originals(pipe)
    record = sd_kernels.patch(pipe, precision="fp8", ops=[], cuda_graph=False)
    latent = _run(pipe, "latent")
    layers = [m for m in model.modules() if isinstance(m, fp8.Fp8Linear)]
    where = {id(m): (m.weight.data_ptr(), m.w_q.data_ptr()) for m in layers}
    moved = sum(m.weight.numel() * m.weight.element_size() for m in layers)

    assert sd_kernels.offload_originals(pipe) is record
    assert all(m.weight.device.type == "cpu" and m.weight.data_ptr() != where[id(m)][0] for m in layers)
    assert all(m.w_q.data_ptr() == where[id(m)][1] for m in layers)  # the codes kept, not made again
    assert record.counts["fp8.original_offloaded"] == len(layers) and record.quantized.offloaded_bytes == moved
    assert "in the CPU's memory" in record.format()
    assert torch.equal(_run(pipe, "latent"), latent)
    sd_kernels.offload_originals(pipe)  # again: nothing more to move
    assert record.counts["fp8.original_offloaded"] == len(layers) and record.quantized.offloaded_bytes == moved

    assert sd_kernels.unpatch(pipe)
    assert all(dict(model.named_parameters())[k] is p for k, p in params.items())
    after = model.state_dict()
    assert all(torch.equal(after[k], state[k]) for k in state)
    assert torch.equal(_run(pipe, "latent"), stock)


def test_codes_on_the_cpu_park_nothing():
    """A model on the CPU (or one accelerate's offload hooks bring in for each call) has nothing on a GPU to free."""
    layer = fp8.Fp8Linear(nn.Linear(32, 16))
    weight = layer.weight.data_ptr()
    assert layer.offload() == 0 and layer.weight.data_ptr() == weight and layer._home is None


def test_offloaded_q_k_v_weights_free_the_buffer_they_were_laid_out_in(park_from_the_cpu):
    """Where the attention patcher laid q, k and v out in one buffer (patches/qkv_fusion.py), the Parameters are
    its only holders: once their weights are parked in the CPU's memory the buffer is freed; restored, each
    weight has storage of its own, the same values."""
    from sd_kernels.patches.qkv_fusion import FusedProjections

    linears = [nn.Linear(32, 16) for _ in range(3)]
    values = [m.weight.detach().clone() for m in linears]
    fused = FusedProjections(linears)
    layers = [fp8.Fp8Linear(m) for m in linears]
    weights = fused.storages[0]
    assert not weights.expired()
    for layer in layers:
        layer.offload()
    assert weights.expired()
    for layer in layers:
        layer.restore()
    fused.release()
    assert all(torch.equal(m.weight, v) for m, v in zip(linears, values))


def test_offload_originals_needs_the_fp8_tier(flux):
    sd_kernels.patch(flux, ops=[], cuda_graph=False)
    try:
        with pytest.raises(ValueError, match="offload_originals: patch this FluxPipeline with precision='fp8'"):
            sd_kernels.offload_originals(flux)
    finally:
        sd_kernels.unpatch(flux)


def test_a_parked_weight_changed_is_quantized_again_cast_goes_back_and_a_replaced_one_stays(park_from_the_cpu,
                                                                                          monkeypatch):
    """A parked weight updated in place is quantized again; the restore takes the parked Parameter back to the
    codes' device, cast since or not; one replaced since stays."""
    moves = []
    real = fp8._copy_to
    monkeypatch.setattr(fp8, "_copy_to", lambda t, device: moves.append((t.shape, t.dtype, device)) or real(t, device))
    layer = fp8.Fp8Linear(nn.Linear(32, 16))
    x = torch.randn(3, 32)
    y = layer(x)
    assert layer.offload() == 32 * 16 * 4 and layer.offload() == 0
    moves.clear()
    assert torch.equal(layer(x), y)
    with torch.no_grad():
        layer.weight.mul_(2)
    assert torch.equal(layer(x), _requantized(layer, x))
    weight = layer.weight
    layer.weight.data = layer.weight.data.double()  # cast while parked (what .to(dtype) does to it)
    layer.restore()
    assert moves == [(torch.Size([16, 32]), torch.float64, layer.w_q.device)]  # back to the codes, as cast
    assert layer.weight is weight and layer._home is None

    layer = fp8.Fp8Linear(nn.Linear(32, 16))
    layer.offload()
    moves.clear()
    replacement = nn.Parameter(torch.randn(16, 32))
    layer.weight = replacement
    layer.restore()
    assert not moves and layer.weight is replacement and layer._home is None
    assert torch.equal(layer(x), _requantized(layer, x))


def test_a_restore_that_fails_stays_for_the_next_unpatch(park_from_the_cpu, monkeypatch):
    """A copy back that fails (out of memory) leaves that layer parked and the step in the record's undo."""
    import types

    layers = [fp8.Fp8Linear(nn.Linear(32, 16)) for _ in range(2)]
    steps = []
    record = types.SimpleNamespace(models=[nn.Sequential(*layers)], quantized=fp8.Fp8Summary(),
                                   counts=collections.Counter(), on_undo=lambda step, kind, count=1: steps.append(step))
    assert fp8.offload_originals(record) == 2 * 32 * 16 * 4 and len(steps) == 1
    real, full = fp8._copy_to, {layers[1].weight.data_ptr()}

    def copy_to(t, device):  # the second layer's copy back runs out of memory, once
        if t.data_ptr() in full:
            full.clear()
            raise torch.OutOfMemoryError("simulated")
        return real(t, device)

    monkeypatch.setattr(fp8, "_copy_to", copy_to)
    with pytest.raises(torch.OutOfMemoryError):
        steps.pop()()
    assert layers[0]._home is None and layers[1]._home is not None and len(steps) == 1  # the step is back
    steps.pop()()
    assert layers[1]._home is None and not steps


def test_an_interrupted_offload_leaves_what_it_parked_to_the_undo(park_from_the_cpu, monkeypatch):
    """Ctrl-C (or out of memory) during the copies: the layers parked so far are in the step the record holds."""
    import types

    layers = [fp8.Fp8Linear(nn.Linear(32, 16)) for _ in range(3)]
    steps = []
    record = types.SimpleNamespace(models=[nn.Sequential(*layers)], quantized=fp8.Fp8Summary(),
                                   counts=collections.Counter(), on_undo=lambda step, kind, count=1: steps.append(step))
    real, stop = fp8._copy_to, layers[1].weight.data_ptr()

    def copy_to(t, device):
        if t.data_ptr() == stop:
            raise KeyboardInterrupt
        return real(t, device)

    monkeypatch.setattr(fp8, "_copy_to", copy_to)
    with pytest.raises(KeyboardInterrupt):
        fp8.offload_originals(record)
    assert [m._home is not None for m in layers] == [True, False, False] and len(steps) == 1
    assert record.counts["fp8.original_offloaded"] == 1 and record.quantized.offloaded_bytes == 32 * 16 * 4
    steps.pop()()
    assert all(m._home is None for m in layers)


def test_inference_tensor_weights_park_and_come_back_as_inference_tensors(park_from_the_cpu):
    with torch.inference_mode():
        layer = fp8.Fp8Linear(nn.Linear(32, 16))
        x = torch.randn(3, 32)
        y = layer(x)
        assert layer.offload() > 0 and layer.weight.is_inference()
        assert torch.equal(layer(x), y)
    layer.restore()
    assert layer.weight.is_inference() and layer._home is None


@pytest.mark.gpu
def test_gpu_offloaded_originals_free_their_bytes_and_come_back():
    """On the GPU the moved weights' memory is freed (the codes stay), the latents are unchanged; a ``.to()``
    that takes the parked weights back keeps the codes; unpatch brings the weights back bit for bit."""
    pipe = build_pipeline("tiny-flux", "cuda", torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer
    state = {k: v.clone() for k, v in model.state_dict().items()}
    record = sd_kernels.patch(pipe, precision="fp8", ops=None, cuda_graph=False)
    latent = _run(pipe, "latent")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sd_kernels.offload_originals(pipe)
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 0.9 * record.quantized.offloaded_bytes > 0, (freed, record.quantized.offloaded_bytes)
    assert torch.equal(_run(pipe, "latent"), latent)
    sd_kernels.unpatch(pipe)
    after = model.state_dict()
    assert all(after[k].device.type == "cuda" and torch.equal(after[k], state[k]) for k in state)

    sd_kernels.patch(pipe, precision="fp8", ops=None, cuda_graph=False)
    sd_kernels.offload_originals(pipe)
    codes = {id(m): m.w_q.data_ptr() for m in model.modules() if isinstance(m, fp8.Fp8Linear)}
    model.to("cuda")  # the parked weights back with the model: their codes serve on
    assert torch.equal(_run(pipe, "latent"), latent)
    assert all(m.w_q.data_ptr() == codes[id(m)] and m._home is None
               for m in model.modules() if isinstance(m, fp8.Fp8Linear))
    sd_kernels.unpatch(pipe)

    sd_kernels.patch(pipe, precision="fp8", ops=None, cuda_graph=False)
    sd_kernels.offload_originals(pipe)
    model.to("cpu")  # the codes follow the model; unpatch puts the weights where the model is now
    sd_kernels.unpatch(pipe)
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_fp8_linear_shares_parameters_and_follows_a_changed_weight():
    linear = nn.Linear(32, 16)
    layer = fp8.Fp8Linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert set(layer.state_dict()) == {"weight", "bias"}  # the codes are not part of the model's state
    x = torch.randn(3, 32)
    before = layer(x)
    with torch.no_grad():
        linear.weight.mul_(2)
    after = layer(x)
    assert rel_err(after - linear.bias, 2 * (before - linear.bias)) < 1e-2  # quantized again: twice the product
    assert rel_err(after, nn.functional.linear(x, linear.weight, linear.bias)) < 0.05



def _requantized(layer: fp8.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    fresh = fp8.Fp8Linear(nn.Linear(layer.in_features, layer.out_features))
    fresh.weight, fresh.bias = layer.weight, layer.bias
    fresh._quantize()
    return fresh(x)


def test_fp8_linear_follows_data_assignment_and_a_dtype_change():
    """``weight.data = ...`` (what ``module.to(dtype or device)`` does) bumps no version counter, and
    ``.to(dtype)`` casts the codes buffer: the layer still quantizes the weight as it is now."""
    layer = fp8.Fp8Linear(nn.Linear(32, 16))
    x = torch.randn(3, 32)
    layer(x)
    layer.weight.data = 2 * layer.weight.data
    assert torch.equal(layer(x), _requantized(layer, x))
    layer.to(torch.bfloat16)
    assert layer.w_q.dtype == torch.bfloat16  # what Module.to does to a float8 buffer
    y = layer(x.bfloat16())
    assert layer.w_q.dtype == torch.float8_e4m3fn and torch.equal(y, _requantized(layer, x.bfloat16()))


def test_fp8_linear_moved_with_its_codes_is_not_quantized_again(monkeypatch):
    """``module.to(device)`` (diffusers' CPU offload, every call) moves the weight and its codes
    together: the codes stay valid and are kept."""
    layer = fp8.Fp8Linear(nn.Linear(32, 16))
    x = torch.randn(3, 32)
    y = layer(x)
    quantized = []
    monkeypatch.setattr(fp8.Fp8Linear, "_quantize", lambda self: quantized.append(self))
    layer._apply(lambda t: t.clone())  # what .to(another device) does: new storage for each, same values
    assert torch.equal(layer(x), y) and not quantized
    layer.weight.data = 2 * layer.weight.data  # the weight alone: stale codes
    layer(x)
    assert quantized


def test_fp8_linear_weights_made_under_inference_mode():
    with torch.inference_mode():
        layer = fp8.Fp8Linear(nn.Linear(32, 16))
        x = torch.randn(3, 32)
        assert torch.equal(layer(x), _requantized(layer, x))


def test_cuda_graphs_see_an_fp8_weight_changed_in_place():
    """A captured graph replays the codes of the weight as it was: an in-place update (load_state_dict)
    keeps every address, so the graph's watch must see it through the layer's ``graph_state``."""
    from sd_kernels.patches.cuda_graph import _Watch

    model = nn.Sequential(fp8.Fp8Linear(nn.Linear(32, 16)))
    watch = _Watch(model)
    before = watch.state(())
    with torch.no_grad():
        model[0].weight.mul_(2)
    assert watch.state(()) != before


@cpu_only
def test_cuda_graphs_see_a_fused_projections_weight_changed_in_place():
    """FLUX's fused q, k, v GEMM reads the three layers' laid-out codes: a graph captured over it is stale once
    one of those weights changes in place, and the patched transformer's watch sees it."""
    from sd_kernels.patches.cuda_graph import _Watch

    model = _model("tiny-flux")
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False) as record:
        assert record.counts["fp8.qkv"]
        watch = _Watch(model)
        before = watch.state(())
        with torch.no_grad():
            model.single_transformer_blocks[0].attn.to_v.weight.mul_(2)
        assert watch.state(()) != before


# ---------------------------------------------------------------------------------------------
# Attention: the processors hand precision="fp8" to the attention op, which runs the FP8 kernel on the
# calls it takes. The tiny configs' head dim (24) is one the FP8 kernel refuses: these models have the
# tiny configs' layout at head dims 64 and 128, in fp16 (the interpreter's bf16 dot is broken).

FP8_HEAD_DIMS = {
    "tiny-flux": {"num_attention_heads": 1, "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24]},
    "tiny-sd3": {"num_attention_heads": 1, "attention_head_dim": 64, "caption_projection_dim": 64},
    "tiny": {"block_out_channels": [64, 128], "attention_head_dim": 1},  # 1 head: 64, and 128 in the mid block
}


def _model(name):
    import diffusers

    part = "unet" if name == "tiny" else "transformer"
    section = {**load_config(name)[part], **FP8_HEAD_DIMS[name]}
    cls = getattr(diffusers, section.pop("class", "UNet2DConditionModel"))
    torch.manual_seed(0)
    return cls.from_config(section).to(torch.float16).eval().requires_grad_(False)


def _call(model, name):
    """One forward of ``model`` in fp16. Keys: FLUX's joint attention 16 image + 4 text tokens, SD3's
    16 + 9, the UNet's self-attention 64 (head dim 64) and 16 (the mid block's, 128), its
    cross-attention 4."""
    g = torch.Generator().manual_seed(0)
    half = lambda v: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    if name == "tiny":
        x, kw = torch.randn(1, 4, 8, 8, generator=g), {"encoder_hidden_states": torch.randn(1, 4, 32, generator=g)}
        kw["timestep"] = 10
    else:
        x, kw = (flux_inputs(model, batch=1, side=4, text=4) if name == "tiny-flux"
                 else sd3_inputs(model, batch=1, side=8))
    with torch.no_grad():
        return model(half(x), **{k: half(v) for k, v in kw.items()}, return_dict=False)[0]


@pytest.fixture
def fp8_attention_calls(monkeypatch):
    """Calls of the FP8 attention kernel's entry point; FP8_MIN_KEYS low enough for the self-attention of
    tiny models (not for the UNet's 4-token cross-attention); the tier's FP8 attention at both head dims."""
    monkeypatch.setattr(attention_op, "FP8_MIN_KEYS", 16)
    monkeypatch.setattr(fp8, "FP8_ATTENTION", (64, 128))
    calls = []
    real = attention_fp8.attention_fp8

    def spy(q, k, *args, **kwargs):
        calls.append(k.shape[-2])
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(attention_fp8, "attention_fp8", spy)
    return calls


def _processors(model):
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


@pytest.mark.integration
@cpu_only
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3", "tiny"])
def test_fp8_patch_routes_attention_to_the_fp8_op_and_unpatch_restores_stock(name, fp8_attention_calls):
    model = _model(name)
    stock_processors = _processors(model)
    stock = _call(model, name)
    assert not fp8_attention_calls

    record = sd_kernels.patch(model, precision="fp8", ops=["attention"], cuda_graph=False)
    ours = [p for p in _processors(model) if type(p) in PRECISION_PROCESSORS]
    assert ours and all(p.precision == "fp8" for p in ours)
    assert record.counts["fp8.attention_processor"] == len(ours) == record.quantized.attention_processors
    assert f"{len(ours)} attention processors run FP8 attention" in record.format()
    out = _call(model, name)
    assert fp8_attention_calls and min(fp8_attention_calls) >= 16  # self-attention only: not 4 keys
    assert rel_err(out, stock) < 0.1, rel_err(out, stock)

    assert sd_kernels.unpatch(model)
    assert all(p.precision == "exact" and "precision" not in vars(p) for p in ours)
    assert all(a is b for a, b in zip(_processors(model), stock_processors, strict=True))
    calls = len(fp8_attention_calls)
    assert torch.equal(_call(model, name), stock) and len(fp8_attention_calls) == calls


@pytest.mark.integration
@cpu_only
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3", "tiny"])
def test_the_fp8_tier_under_inference_mode_runs_and_stays_close(name, fp8_attention_calls):
    """The whole tier, FP8 attention included, called under ``torch.inference_mode()`` (its tensors keep no version
    counter: the statistics and codes that travel between kernels by version stay home, each kernel makes its own)
    gives the tier's output within its own rounding of what ``torch.no_grad()`` gives. FLUX's FP8 attention
    failed here once: its q/k norm + RoPE handed over K/V statistics of inference tensors."""
    model = _model(name)
    sd_kernels.patch(model, precision="fp8", cuda_graph=False)
    try:
        want = _call(model, name)
        calls = len(fp8_attention_calls)
        with torch.inference_mode():
            got = _call(model, name)
        assert len(fp8_attention_calls) == 2 * calls > 0
    finally:
        sd_kernels.unpatch(model)
    assert rel_err(got, want) < 2e-2, rel_err(got, want)


@pytest.mark.integration
@cpu_only
def test_the_fp8_tier_first_called_under_inference_mode_then_outside_it(monkeypatch):
    """FLUX's FP8 pipeline called under ``torch.inference_mode()`` first, then outside it: the joined modulations'
    step table, made at the first call, is filled in place by the second (made outside inference mode, it can be),
    and both give the tier's latents of a call outside it."""
    pipe = build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    record = sd_kernels.patch(pipe, precision="fp8", cuda_graph=False)
    try:
        assert record.quantized.step_tables
        with torch.inference_mode():
            first = _run(pipe, "latent")
        second, third = _run(pipe, "latent"), _run(pipe, "latent")
    finally:
        sd_kernels.unpatch(pipe)
    assert torch.equal(second, third) and rel_err(first, second) < 2e-2, rel_err(first, second)


@pytest.mark.integration
@cpu_only
def test_flux_fp8_attention_takes_its_key_statistics_from_the_norm_and_rotation(fp8_attention_calls, monkeypatch):
    """FLUX's processors under the FP8 tier write the keys with qk_norm_rope_fp8 and hand its K/V statistics to
    the attention: every FP8 attention call gets them and the pre-pass's own statistics kernel never runs; the
    output is the one the pre-pass gives with its own statistics, within K's codes' one-step moves."""
    model = _model("tiny-flux")
    given, passes = [], []
    spied = attention_fp8.attention_fp8
    monkeypatch.setattr(attention_fp8, "attention_fp8",
                        lambda *a, **kw: given.append(kw.get("kv_stats") is not None) or spied(*a, **kw))
    launch = attention_fp8._STATS
    monkeypatch.setattr(attention_fp8, "_STATS", lambda *a, **kw: passes.append(1) or launch(*a, **kw))
    sd_kernels.patch(model, precision="fp8", ops=["attention"], cuda_graph=False)
    try:
        out = _call(model, "tiny-flux")
        assert given and all(given) and not passes
        monkeypatch.setattr(attention_fp8.KvStats, "serves", lambda *_: False)  # the pre-pass's own statistics
        own = _call(model, "tiny-flux")
        assert len(passes) == len(given) // 2
    finally:
        sd_kernels.unpatch(model)
    assert rel_err(out, own) < 1e-2, rel_err(out, own)


@cpu_only
def test_the_fp8_tier_keeps_attention_exact_while_fp8_attention_is_off(fp8_attention_calls, monkeypatch):
    monkeypatch.setattr(fp8, "FP8_ATTENTION", ())
    model = _model("tiny-flux")
    record = sd_kernels.patch(model, precision="fp8", ops=["attention"], cuda_graph=False)
    try:
        ours = [p for p in _processors(model) if type(p) in PRECISION_PROCESSORS]
        assert ours and all(p.precision == "exact" for p in ours)
        assert "fp8.attention_processor" not in record.counts and record.quantized.attention_processors == 0
        _call(model, "tiny-flux")
        assert not fp8_attention_calls
    finally:
        sd_kernels.unpatch(model)


@cpu_only
def test_lossless_patch_keeps_attention_exact(fp8_attention_calls):
    model = _model("tiny-flux")
    record = sd_kernels.patch(model, ops=["attention"], cuda_graph=False)
    try:
        ours = [p for p in _processors(model) if type(p) in PRECISION_PROCESSORS]
        assert ours and all(p.precision == "exact" for p in ours)
        assert "fp8.attention_processor" not in record.counts
        _call(model, "tiny-flux")
        assert not fp8_attention_calls
    finally:
        sd_kernels.unpatch(model)


@cpu_only
def test_fp8_attention_only_at_the_head_dims_it_is_listed_for(fp8_attention_calls, monkeypatch):
    """With ``FP8_ATTENTION = (128,)`` (the shipped choice): the tiny UNet's mid-block attention (128) runs
    FP8, its 64-wide attention stays exact."""
    monkeypatch.setattr(fp8, "FP8_ATTENTION", (128,))
    model = _model("tiny")
    sd_kernels.patch(model, precision="fp8", ops=["attention"], cuda_graph=False)
    try:
        modules = [m for m in model.modules() if type(getattr(m, "processor", None)) in PRECISION_PROCESSORS]
        by_dim = {(m.inner_dim // m.heads, m.processor.precision) for m in modules if m.is_cross_attention is False}
        assert (128, "fp8") in by_dim and (64, "exact") in by_dim and (64, "fp8") not in by_dim
        _call(model, "tiny")
        assert fp8_attention_calls == [16]  # the mid block's 16 keys; none of the 64-wide attention's 64
    finally:
        sd_kernels.unpatch(model)


@cpu_only
def test_the_vae_attention_stays_exact(monkeypatch):
    pipe = build_pipeline("tiny")
    head_dims = {m.inner_dim // m.heads for part in (pipe.unet, pipe.vae) for m in part.modules()
                 if hasattr(m, "processor")}
    monkeypatch.setattr(fp8, "FP8_ATTENTION", tuple(head_dims))
    sd_kernels.patch(pipe, precision="fp8", ops=["attention"], cuda_graph=False)
    try:
        vae, unet = ([p for p in _processors(m) if type(p) in PRECISION_PROCESSORS] for m in (pipe.vae, pipe.unet))
        assert vae and all(p.precision == "exact" for p in vae)
        assert unet and all(p.precision == "fp8" for p in unet)
    finally:
        sd_kernels.unpatch(pipe)


# ---------------------------------------------------------------------------------------------
# The DiT blocks' fusions of the FP8 tier: the single block's join, the gated residuals


def _half(*shape):
    return torch.randn(*shape).half()


def test_fp8_joined_is_the_gated_projection_of_the_concatenation():
    """``Fp8Linear.joined``: ``residual + gate · proj_out(cat([attention, gelu(mlp)]))`` with the join,
    the GELU and the quantization in one kernel and the gate and add in the GEMM's epilogue, against the
    same written out: apart only in where the GELU and the epilogue round (a code a step off here and there)."""
    torch.manual_seed(0)
    lin = fp8.Fp8Linear(nn.Linear(24 + 40, 16).half())
    prefix, x, gate, residual = _half(2, 5, 24), _half(2, 5, 40) * 2, _half(2, 16), _half(2, 5, 16)
    ours = lin.joined(prefix, x, "tanh", gate, residual)
    written = residual + gate[:, None] * lin(torch.cat([prefix, torch.nn.functional.gelu(x, approximate="tanh")], -1))
    assert ours.dtype == torch.float16 and ours.shape == residual.shape
    assert rel_err(ours, written) < 1e-2, rel_err(ours, written)


def test_fp8_feed_forward_gated_residual():
    """``Fp8FeedForward.gated_residual``: the gate and the residual in its second GEMM's epilogue."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(32, activation_fn="gelu-approximate").half().eval()
    fused = fp8.Fp8FeedForward(ff, "tanh", False)
    ff.net[0].proj, ff.net[2] = fp8.Fp8Linear(ff.net[0].proj), fp8.Fp8Linear(ff.net[2])
    h, gate, residual = _half(2, 6, 32), _half(2, 32), _half(2, 6, 32)
    ours = fused.gated_residual(h, gate, residual)
    assert rel_err(ours, residual + gate[:, None] * fused(h)) < 1e-2
    fused.train()  # training: the original forward, the same sum written out
    assert torch.equal(fused.gated_residual(h, gate, residual), residual + gate[:, None] * ff(h))
    # the gate or the residual alone, as the fused path takes them
    assert torch.equal(fused.gated_residual(h, gate), gate[:, None] * ff(h))
    assert torch.equal(fused.gated_residual(h, None, residual), residual + ff(h))
    fused.eval()
    assert rel_err(fused.gated_residual(h, None, residual), residual + fused(h)) < 1e-2


def _geglu_feed_forward(dim=32, device="cpu"):
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(dim, activation_fn="geglu").half().eval().to(device)
    fused = fp8.Fp8FeedForward(ff, "none", True)
    ff.net[0].proj, ff.net[2] = fp8.Fp8Linear(ff.net[0].proj), fp8.Fp8Linear(ff.net[2])
    return ff, fused


@torch.no_grad()  # as a pipeline calls it (Parameters that require grad take the reference)
def test_fp8_geglu_feed_forward_takes_the_epilogue_and_matches_the_two_kernel_path(count_calls, monkeypatch):
    """With the GEGLU epilogue switched on, a GEGLU feed-forward's first GEMM writes a · gelu(g)
    (ops/fp8_geglu.py) and reads the codes its input carries: the output within fp16's roundings of the two-kernel
    path (GEMM, then the GEGLU quantizer), which the switch off (the default), a hook on the projection or a K the
    TMA unit cannot read bring back. On the CPU through the interpreter; a GPU host runs it on CUDA tensors (CPU
    tensors there take the reference)."""
    fg = importlib.import_module("sd_kernels.ops.fp8_geglu")
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", True)  # opt-in
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ff, fused = _geglu_feed_forward(device=device)
    h = _half(2, 6, 32).to(device)
    launched = count_calls(fg, geglu="_GEGLU")
    quantized = count_calls(fp8_ops, rows="quantize_rows")
    q, s = fp8_ops.quantize_rows(h)
    fp8_ops.attach_quantized(h, q, s)
    ours = fused(h)
    assert launched == {"geglu": 1} and quantized["rows"] == 1  # the input's codes were read, not made again
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", False)
    apart = fused(h)
    assert launched == {"geglu": 1}
    assert ours.shape == apart.shape == h.shape and rel_err(ours, apart) < 2e-2, rel_err(ours, apart)
    second = ff.net[2]
    stock = torch.nn.functional.linear(_geglu(ff, h).float(), second.weight.float(), second.bias.float())
    assert rel_err(ours, stock) < 5e-2, rel_err(ours, stock)  # two e4m3 quantizations
    monkeypatch.setattr(fg, "GEGLU_EPILOGUE", True)
    handle = ff.net[0].proj.register_forward_hook(lambda *a: None)  # a hook the fused path would pass by
    fused(h)
    handle.remove()
    assert launched == {"geglu": 1}
    _, odd = _geglu_feed_forward(dim=24, device=device)  # K = 24: rows of 24 bytes, off the TMA unit's 16-byte grid
    odd(_half(2, 6, 24).to(device))
    assert launched == {"geglu": 1}


def _geglu(ff, h):
    """diffusers' GEGLU of the stock layers' weights, in fp32."""
    proj = ff.net[0].proj
    a, g = (h.float() @ proj.weight.float().t() + proj.bias.float()).chunk(2, -1)
    return a * torch.nn.functional.gelu(g)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts of the tier's fused block calls: ``Fp8Linear.joined`` and ``Fp8FeedForward.gated_residual``
    with a gate (a traced call counts once, when traced)."""
    calls = {"joined": 0, "gated": 0}
    joined, gated = fp8.Fp8Linear.joined, fp8.Fp8FeedForward.gated_residual

    def spy_joined(self, *args, **kwargs):
        calls["joined"] += 1
        return joined(self, *args, **kwargs)

    def spy_gated(self, h, gate=None, residual=None):
        calls["gated"] += gate is not None
        return gated(self, h, gate, residual)

    monkeypatch.setattr(fp8.Fp8Linear, "joined", spy_joined)
    monkeypatch.setattr(fp8.Fp8FeedForward, "gated_residual", spy_gated)
    return calls


@pytest.mark.integration
@cpu_only
@pytest.mark.parametrize("joined", [True, False], ids=["modulations-joined", "modulations-apart"])
def test_fp8_flux_blocks_take_the_fused_join_and_gated_residuals(fused_calls, count_calls, monkeypatch, joined):
    """With the blocks' fused forwards (``layer_norm``), the FP8 tier's single blocks run ``joined`` and
    the double blocks' feed-forwards their gated residual; the output stays close to stock's. The inputs
    quantized apart from their producers: the step embedding's SiLU once a call (every block's modulation
    reads it, one GEMM for all as shipped or each norm's own: patches/fp8_modulations.py), each double block's
    two attention outputs; each norm2 writes its feed-forward's codes. With each norm's own GEMM, the SiLU is
    made once for all of them too."""
    monkeypatch.setattr(fp8, "JOIN_MODULATIONS", joined)
    model = _model("tiny-flux")
    stock = _call(model, "tiny-flux")
    calls = fused_calls
    sd_kernels.patch(model, precision="fp8", ops=["layer_norm"], cuda_graph=False)
    quantized = count_calls(fp8_ops, quantize="quantize_rows")
    silu = count_calls(torch.nn.functional, silu="silu")
    out = _call(model, "tiny-flux")
    singles, doubles = len(model.single_transformer_blocks), len(model.transformer_blocks)
    assert calls == {"joined": singles, "gated": 2 * doubles}, calls
    plain = [a for a in quantized.args["quantize"] if not a["act"]]  # not the GELUs' quantization
    assert len(plain) == 1 + 2 * doubles, [tuple(a["x"].shape) for a in plain]
    if not joined:
        shared = silu["silu"]
        with pytest.MonkeyPatch.context() as mp:  # each norm's own SiLU, as diffusers' blocks make it
            mp.setattr(modulation_split, "silu", lambda norm, emb: norm.silu(emb))
            assert torch.equal(_call(model, "tiny-flux"), out)
        assert silu["silu"] - 2 * shared == 2 * doubles + singles - 1, silu  # one SiLU for the blocks' norms
    assert rel_err(out, stock) < 0.1, rel_err(out, stock)
    assert sd_kernels.unpatch(model)
    assert torch.equal(_call(model, "tiny-flux"), stock)


@pytest.mark.integration
@cpu_only
def test_fp8_flux_q_k_v_are_one_gemm_a_stream(monkeypatch):
    """Where the attention patcher laid a FLUX attention's q, k, v weights out in one buffer, the FP8 tier
    lays their codes out alike and runs one GEMM a stream: the same output as three GEMMs on the same
    codes; a weight changed while patched sends that stream back to three GEMMs (the block's other stream
    stays one GEMM); unpatch is exact."""
    name = "tiny-flux"
    model = _model(name)
    stock = _call(model, name)
    served = {"fused": 0, "declined": 0}
    call = fp8.Fp8Projections.__call__

    def spy(self, *args):
        y = call(self, *args)
        served["fused" if y is not None else "declined"] += 1
        return y

    monkeypatch.setattr(fp8.Fp8Projections, "__call__", spy)
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False) as record:
        streams = len(model.single_transformer_blocks) + 2 * len(model.transformer_blocks)
        assert record.counts["fp8.qkv"] == record.counts["qkv_fusion"] == streams
        fused = _call(model, name)
        assert served == {"fused": streams, "declined": 0}
        monkeypatch.setattr(fp8.Fp8Projections, "__call__", lambda self, *args: None)
        separate = _call(model, name)
        torch.testing.assert_close(fused, separate, rtol=0, atol=2e-3)  # fp16 outputs, GEMM tiles alike
        monkeypatch.setattr(fp8.Fp8Projections, "__call__", spy)
        attn = model.transformer_blocks[0].attn
        with torch.no_grad():
            attn.to_k.weight.mul_(2)  # in place through the Parameter: its codes are made again
        served.update(fused=0, declined=0)
        changed = _call(model, name)
        assert served == {"fused": streams - 1, "declined": 1}
        assert not torch.equal(changed, fused)
        with torch.no_grad():
            attn.to_k.weight.div_(2)
    assert torch.equal(_call(model, name), stock)


HOOKED = {  # modules a fused block path applies without calling them, and the fused call that would pass them by
    "tiny-flux": [("single_transformer_blocks.0.proj_out", "joined"), ("single_transformer_blocks.0.act_mlp", "joined"),
                  ("transformer_blocks.0.ff", "gated"), ("transformer_blocks.0.ff.net.0", "gated"),
                  ("transformer_blocks.0.ff.net.2", "gated")],
    "tiny-sd3": [("transformer_blocks.0.ff_context", "gated")],
}


@pytest.mark.integration
@cpu_only
@pytest.mark.parametrize("name", sorted(HOOKED))
def test_fp8_fused_blocks_call_a_hooked_module_as_itself(name, fused_calls):
    """The join and the gated residuals call methods of ``proj_out`` / the feed-forward, and apply the
    single blocks' GELU and the feed-forward's activation and second GEMM without calling those modules:
    a module with a forward hook (a user's, accelerate's offload, bench.fp8's per-layer error hooks) is
    called as itself, so that its hooks run, as they do in stock's forward and in the unfused tier."""
    model, calls = _model(name), fused_calls
    sd_kernels.patch(model, precision="fp8", ops=["layer_norm"], cuda_graph=False)
    try:
        plain = _call(model, name)
        for path, fused in HOOKED[name]:
            assert calls[fused] > 0, calls  # unhooked: the fused path
            module, seen = model.get_submodule(path), []
            handle = module.register_forward_hook(lambda m, args, out, seen=seen: seen.append(1) or out * 0)
            hooked = _call(model, name)
            handle.remove()
            assert seen, f"the hook on {path} did not run"
            assert not torch.equal(hooked, plain), path  # the hook's zeros reached the output
    finally:
        sd_kernels.unpatch(model)


@cpu_only
def test_lossless_single_blocks_call_a_hooked_gelu_as_itself():
    """The lossless single-block forward writes the MLP's GELU with our kernel (``_mlp_beside``): a hook on
    ``act_mlp`` makes it call the module, so that the hook runs."""
    model = _model("tiny-flux")
    sd_kernels.patch(model, ops=["layer_norm"], cuda_graph=False)
    try:
        plain, seen = _call(model, "tiny-flux"), []
        handle = model.single_transformer_blocks[0].act_mlp.register_forward_hook(
            lambda m, args, out: seen.append(1) or out * 0)
        hooked = _call(model, "tiny-flux")
        handle.remove()
        assert seen and not torch.equal(hooked, plain)
    finally:
        sd_kernels.unpatch(model)


@pytest.mark.integration
@cpu_only
def test_fp8_compiled_blocks_take_the_gated_residuals_not_the_join(fused_calls):
    """Traced (aot_eager: the custom ops' fakes), the double blocks' gated residuals still go to the
    GEMM's epilogue and the single blocks' join is written out (``joined`` is eager only), as
    docs/fp8.md says; the output is the eager call's up to the epilogue's rounding."""
    model, calls = _model("tiny-flux"), fused_calls
    sd_kernels.patch(model, precision="fp8", ops=["layer_norm"], cuda_graph=False)
    try:
        eager = _call(model, "tiny-flux")
        calls.update(joined=0, gated=0)
        torch._dynamo.reset()
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(backend="aot_eager", fullgraph=True)
        compiled = _call(model, "tiny-flux")
        assert calls["joined"] == 0 and calls["gated"] > 0, calls
        assert rel_err(compiled, eager) < 1e-2, rel_err(compiled, eager)
    finally:
        sd_kernels.unpatch(model)
        torch._dynamo.reset()
