"""The FP8 tier's block-norm modulations as one GEMM a call (patches/fp8_modulations.py), and cuBLASLt held
without a workspace while the tier is patched (sd_kernels/runtime/blas.py)."""

import os

import pytest
import torch
from dit_checks import cpu_only
from sd_kernels.patches import fp8, fp8_modulations
from sd_kernels.patches.qkv_fusion import stacked
from test_fp8_patch import _call, _model

import sd_kernels
from sd_kernels.runtime import blas

NORMS = {"tiny-flux": lambda m: 2 * len(m.transformer_blocks) + len(m.single_transformer_blocks),
         "tiny-sd3": lambda m: 2 * len(m.transformer_blocks) - 1}  # the last block's context norm: another kind


@pytest.fixture
def joined_calls(monkeypatch):
    """How many joined GEMMs ran, and how many block norms computed their own product."""
    calls = {"joined": 0, "own": 0}
    compute, forward = fp8_modulations.Fp8Modulations._compute, fp8.Fp8Linear.forward
    norm_layers: set[int] = set()

    def joined(self, x):
        norm_layers.update(map(id, self.layers))
        y = compute(self, x)
        calls["joined"] += y is not None
        return y

    def own(self, x):
        calls["own"] += id(self) in norm_layers
        return forward(self, x)

    monkeypatch.setattr(fp8_modulations.Fp8Modulations, "_compute", joined)
    monkeypatch.setattr(fp8.Fp8Linear, "forward", own)
    return calls


def _norms(model):
    return [m for m in model.modules() if isinstance(m, fp8.Fp8AdaLayerNormZero)]


@cpu_only
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
def test_block_norms_take_one_modulation_gemm_a_call(name, joined_calls, monkeypatch):
    """Every block norm of a call reads its columns of one GEMM: one joined GEMM a call and no norm's own, the
    output as with each norm's own GEMM on the same codes (fp16 outputs); unpatch is exact."""
    model = _model(name)
    stock = _call(model, name)
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False) as record:
        norms = _norms(model)
        assert len(norms) == record.counts["fp8.modulation_joined"] == NORMS[name](model)
        assert f"{len(norms)} block norms' modulations one GEMM a call" in record.format()
        assert len({id(n.modulations) for n in norms}) == 1
        codes = stacked([n.linear.w_q for n in norms])
        assert codes is not None and codes.shape[0] == sum(n.linear.out_features for n in norms)
        joined = _call(model, name)
        assert joined_calls == {"joined": 1, "own": 0}
        _call(model, name)
        assert joined_calls == {"joined": 2, "own": 0}  # the next call computes anew
        monkeypatch.setattr(fp8_modulations.Fp8Modulations, "product", lambda self, norm, emb: None)
        own = _call(model, name)
        assert joined_calls == {"joined": 2, "own": len(norms)}
    torch.testing.assert_close(joined, own, rtol=0, atol=2e-3)  # fp16 outputs, the same codes
    assert torch.equal(_call(model, name), stock)
    assert not any(isinstance(m, fp8.Fp8AdaLayerNormZero) for m in model.modules())


@cpu_only
def test_the_joined_product_is_each_norms_own_in_fp32():
    """Each norm's columns of the joined GEMM against its own layer on the same input: fp32 outputs, equal up to
    the accumulation's rounding."""
    model = _model("tiny-flux").float()
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False), torch.no_grad():
        emb = torch.randn(2, model.inner_dim, generator=torch.Generator().manual_seed(1))
        for norm in _norms(model):
            mine = norm.modulations.product(norm, emb)
            assert mine is not None and mine.shape == (2, norm.linear.out_features)
            torch.testing.assert_close(mine, norm.linear(norm.silu(emb)), rtol=1e-5, atol=1e-6)


@cpu_only
def test_a_changed_weight_a_hook_autograd_and_inference_mode_take_each_norms_own(joined_calls):
    """Where the joined GEMM cannot serve (module docstring), each norm computes its own product, once a call:
    the output as with the modulations not joined."""
    name = "tiny-flux"
    model = _model(name)
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False):
        norms = _norms(model)
        layer = norms[1].linear
        with torch.no_grad():
            layer.weight.mul_(2)  # its codes made again into buffers of their own: the layout is broken
        changed = _call(model, name)
        assert joined_calls == {"joined": 0, "own": len(norms)}
        with torch.no_grad():
            layer.weight.div_(2)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fp8, "JOIN_MODULATIONS", False)
            sd_kernels.unpatch(model)
            sd_kernels.patch(model, precision="fp8", cuda_graph=False)
            with torch.no_grad():
                _norms(model)[1].linear.weight.mul_(2)
            reference = _call(model, name)
            with torch.no_grad():
                _norms(model)[1].linear.weight.div_(2)
        torch.testing.assert_close(changed, reference, rtol=0, atol=0)
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False):
        norms = _norms(model)
        joined_calls.update(joined=0, own=0)
        handle = norms[3].linear.register_forward_hook(lambda *args: None)
        _call(model, name)
        assert joined_calls == {"joined": 0, "own": len(norms)}
        handle.remove()
        joined_calls.update(joined=0, own=0)
        with torch.inference_mode():
            _call(model, name)
        assert joined_calls == {"joined": 0, "own": len(norms)}
        emb = torch.randn(1, model.inner_dim, requires_grad=True)
        assert norms[0].modulations.product(norms[0], emb) is None  # autograd tracks it
        with torch.no_grad():
            assert norms[0].modulations.product(norms[0], emb) is not None


@cpu_only
def test_the_biases_are_laid_out_as_the_model_s_parameters_and_get_their_storage_back(joined_calls):
    """The block norms' biases (the model's Parameters) are views of one buffer while patched: an update in
    place is the joined GEMM's; a bias assigned anew sends every norm back to its own product; unpatch gives
    each its own storage, the same Parameter and values."""
    model = _model("tiny-flux").float()
    kinds = ("AdaLayerNormZero", "AdaLayerNormZeroSingle")
    biases = [m.linear.bias for m in model.modules() if type(m).__name__ in kinds]
    before = [b.detach().clone() for b in biases]
    emb = torch.randn(1, model.inner_dim, generator=torch.Generator().manual_seed(2))
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False), torch.no_grad():
        norms = _norms(model)
        assert all(n.linear.bias is b for n, b in zip(norms, biases, strict=True))  # the same Parameters, in order
        assert stacked(biases) is not None
        layer = norms[2].linear
        layer.bias.add_(1.0)  # in place: the buffer the joined GEMM reads
        torch.testing.assert_close(norms[2].modulations.product(norms[2], emb), layer(norms[2].silu(emb)),
                                   rtol=1e-5, atol=1e-6)
        layer.bias.sub_(1.0)
        assert joined_calls["joined"] == 1
        original, layer.bias = layer.bias, torch.nn.Parameter(layer.bias.detach().clone())  # assigned anew
        assert norms[0].modulations.product(norms[0], emb.clone()) is None
        layer.bias = original
    assert len({b.untyped_storage().data_ptr() for b in biases}) == len(biases)  # each its own again
    assert all(torch.equal(b, v) for b, v in zip(biases, before))


def test_stacked_lays_out_blocks_of_different_lengths():
    buffer = torch.arange(24.0).view(8, 3)
    parts = [buffer[:2], buffer[2:7], buffer[7:]]
    whole = stacked(parts)
    assert whole is not None and torch.equal(whole, buffer) and whole.data_ptr() == buffer.data_ptr()
    assert stacked([buffer[:2], buffer[3:]]) is None  # a gap
    assert stacked([buffer[:2], buffer[2:4, :2]]) is None  # another trailing shape
    assert stacked([]) is None


@pytest.fixture
def env_route(monkeypatch):
    """runtime.blas by the environment variable (torch without the setter), no variable set before."""
    monkeypatch.setattr(blas, "_setter", lambda: None)
    monkeypatch.delenv(blas.ENV, raising=False)
    assert blas.held() == 0


def test_holds_nest_and_the_last_release_sets_back(env_route):
    first = blas.hold()
    assert os.environ[blas.ENV] == "0"
    second = blas.hold()
    first()
    first()  # a second release of one hold does nothing
    assert os.environ[blas.ENV] == "0" and blas.held() == 1
    second()
    assert blas.ENV not in os.environ and blas.held() == 0


def test_a_users_setting_is_left_alone(env_route, monkeypatch):
    monkeypatch.setenv(blas.ENV, "1048576")
    assert blas.hold() is None
    assert os.environ[blas.ENV] == "1048576" and blas.held() == 0


def test_torchs_setter_where_it_has_one(monkeypatch):
    sizes = [33554432]

    def setter(size=None):
        if size is not None:
            sizes.append(size)
        return sizes[-1]

    monkeypatch.setattr(blas, "_setter", lambda: setter)
    monkeypatch.delenv(blas.ENV, raising=False)
    release = blas.hold()
    assert sizes[-1] == 0 and blas.ENV not in os.environ
    release()
    assert sizes == [33554432, 0, 33554432]


@cpu_only
@pytest.mark.parametrize("on", [True, False])
def test_the_tier_holds_no_workspace_while_patched_where_torch_serves_its_gemms(env_route, monkeypatch, on):
    """Where torch's ``_scaled_mm`` serves the tier's GEMMs (faked here: the CPU has none), the patch holds
    cuBLASLt without a workspace until unpatch; ``NO_CUBLASLT_WORKSPACE`` off, or where our kernels serve,
    nothing changes."""
    monkeypatch.setattr(fp8, "NO_CUBLASLT_WORKSPACE", on)
    model = _model("tiny-flux")
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False) as record:
        assert blas.ENV not in os.environ and "fp8.cublaslt_workspace_off" not in record.counts  # our kernels serve
    monkeypatch.setattr(fp8, "torch_gemm_on", lambda device, dtype, profile: True)
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False) as record:
        assert (os.environ.get(blas.ENV) == "0") is on
        assert record.counts["fp8.cublaslt_workspace_off"] == int(on)
        assert ("cuBLASLt without a workspace" in record.format()) is on
    assert blas.ENV not in os.environ and blas.held() == 0
