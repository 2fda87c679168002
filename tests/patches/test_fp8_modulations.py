"""The FP8 tier's block-norm modulations as one GEMM a call (patches/fp8_modulations.py), and cuBLASLt without a
workspace for the GEMMs a CUDA graph captures (sd_kernels/runtime/blas.py)."""

import importlib
import os
from types import SimpleNamespace

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

    def joined(self, emb, norm, where):
        norm_layers.update(map(id, self.layers))
        entry = compute(self, emb, norm, where)
        calls["joined"] += entry[2] is not None
        return entry

    def own(self, x):
        calls["own"] += id(self) in norm_layers
        return forward(self, x)

    monkeypatch.setattr(fp8_modulations.Fp8Modulations, "_compute", joined)
    monkeypatch.setattr(fp8.Fp8Linear, "forward", own)
    return calls


def _norms(model):
    return [m for m in model.modules() if isinstance(m, fp8.Fp8AdaLayerNormZero)]


@pytest.mark.integration
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
        assert f"the modulations of {len(norms)} block norms as 1 GEMM a call" in record.format()
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


@pytest.mark.integration
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


@cpu_only
def test_the_same_embedding_again_sees_what_changed_since(joined_calls):
    """A call with the same step embedding (object and version) reuses the joined result only while nothing it
    depends on changed: a bias or weight updated in place, a hook added, the result edited in place through a
    returned chunk; each case gives what the norm's own layer gives now."""
    model = _model("tiny-flux").float()
    emb = torch.randn(1, model.inner_dim, generator=torch.Generator().manual_seed(3))
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False), torch.no_grad():
        norms = _norms(model)
        joined = norms[0].modulations

        def own(norm):
            return norm.linear(norm.silu(emb))

        first = [joined.product(n, emb).clone() for n in norms]
        assert joined_calls["joined"] == 1
        norms[1].linear.bias.add_(1.0)  # in place: the laid-out buffer, the result computed before it
        torch.testing.assert_close(joined.product(norms[1], emb), own(norms[1]), rtol=1e-5, atol=1e-6)
        assert not torch.equal(joined.product(norms[1], emb), first[1]) and joined_calls["joined"] == 2
        norms[1].linear.bias.sub_(1.0)
        joined.product(norms[0], emb).add_(5.0)  # a returned chunk edited in place
        torch.testing.assert_close(joined.product(norms[0], emb), first[0], rtol=1e-5, atol=1e-6)
        handle = norms[2].linear.register_forward_hook(lambda *args: None)  # a hook added after the GEMM ran
        assert joined.product(norms[2], emb) is None
        handle.remove()
        norms[3].linear.weight.mul_(2.0)  # in place: codes made again, the layout broken
        assert joined.product(norms[3], emb) is None and joined.product(norms[0], emb) is None
        norms[3].linear.weight.div_(2.0)


@cpu_only
def test_a_result_made_in_a_capture_serves_only_that_capture(joined_calls, monkeypatch):
    """The same embedding in and out of a CUDA graph's capture (faked: the CPU has none): a result made eagerly is
    not baked into a capture, one made in a capture (not run yet) is not read eagerly."""
    model = _model("tiny-flux").float()
    emb = torch.randn(1, model.inner_dim)
    where = {"now": (False, 1)}
    monkeypatch.setattr(fp8_modulations, "_where", lambda emb: where["now"])
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False), torch.no_grad():
        norm = _norms(model)[0]
        for now, computed in (((False, 1), 1), ((True, 2), 2), ((True, 2), 2), ((False, 1), 3)):
            where["now"] = now
            assert norm.modulations.product(norm, emb) is not None
            assert joined_calls["joined"] == computed


def test_inference_mode_with_an_embedding_made_outside_it_takes_each_norms_own():
    """Under inference mode the outputs keep no version counter: each norm computes its own product (and its own
    SiLU), whatever the embedding."""
    model = _model("tiny-flux").float()
    emb = torch.randn(1, model.inner_dim)  # made outside: a normal tensor
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False):
        norm = _norms(model)[0]
        with torch.inference_mode():
            assert norm.modulations.product(norm, emb) is None
            y = norm(torch.randn(1, 4, model.inner_dim), emb=emb)
        assert all(t.isfinite().all() for t in y)


def test_stacked_lays_out_blocks_of_different_lengths():
    buffer = torch.arange(24.0).view(8, 3)
    parts = [buffer[:2], buffer[2:7], buffer[7:]]
    whole = stacked(parts)
    assert whole is not None and torch.equal(whole, buffer) and whole.data_ptr() == buffer.data_ptr()
    assert stacked([buffer[:2], buffer[3:]]) is None  # a gap
    assert stacked([buffer[:2], buffer[2:4, :2]]) is None  # another trailing shape
    assert stacked([]) is None


@pytest.fixture
def capturing(monkeypatch):
    """runtime.blas as on a stream capturing a CUDA graph (the CPU has none), torch without the setter (the
    environment variable's route), no variable set before; ``capturing["stream"]`` the current stream."""
    state = {"capturing": True, "stream": 1}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: 7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=state["stream"]))
    monkeypatch.setattr(blas, "_setter", lambda: None)
    monkeypatch.delenv(blas.ENV, raising=False)
    return state


def _inside() -> tuple:
    with blas.no_workspace() as held:
        return held, os.environ.get(blas.ENV)


def test_a_captured_gemm_runs_without_a_workspace_once_its_stream_has_one(capturing):
    assert _inside() == (False, None)  # outside our captures (torch.compile's, anyone's): as torch sets it
    with blas.capture_scope():
        assert _inside() == (False, None)  # the stream's first GEMM: torch makes its workspace, default size
        assert _inside() == (True, "0")
        assert blas.ENV not in os.environ
        capturing["stream"] = 2  # another stream: its first GEMM again as torch sets it
        assert _inside() == (False, None)
        capturing["capturing"] = False  # an eager call inside the scope: left alone
        assert _inside() == (False, None)
    capturing.update(capturing=True, stream=1)
    with blas.capture_scope():  # a new capture primes anew (torch may have cleared its workspaces since)
        assert _inside() == (False, None)
        assert _inside() == (True, "0")


def test_a_gemm_that_raises_primes_nothing(capturing):
    with blas.capture_scope():
        with pytest.raises(RuntimeError), blas.no_workspace():
            raise RuntimeError("out of memory")
        assert _inside() == (False, None)


def test_a_users_setting_is_left_alone(capturing, monkeypatch):
    monkeypatch.setenv(blas.ENV, "1024")
    with blas.capture_scope():
        assert _inside() == (False, "1024")
        assert _inside() == (False, "1024") and os.environ[blas.ENV] == "1024"


def test_torchs_setter_where_it_has_one(capturing, monkeypatch):
    sizes = [33554432]

    def setter(size=None):
        if size is not None:
            sizes.append(size)
        return sizes[-1]

    monkeypatch.setattr(blas, "_setter", lambda: setter)
    with blas.capture_scope():
        _inside()
        assert _inside() == (True, None)
    assert sizes == [33554432, 0, 33554432]


def test_the_fp8_gemm_on_torch_runs_inside_it(capturing, monkeypatch):
    """``_torch_gemm`` (torch's ``_scaled_mm``, faked: the CPU has none) runs its GEMM inside ``no_workspace``;
    ``NO_CUBLASLT_WORKSPACE`` off, outside."""
    fp8_linear = importlib.import_module("sd_kernels.ops.fp8_linear")
    seen = []

    def scaled_mm(a, b, **kwargs):
        seen.append(os.environ.get(blas.ENV))
        return torch.zeros(a.shape[0], b.shape[1])

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    a, w, sa, sw = torch.zeros(4, 16), torch.zeros(8, 16), torch.ones(4), torch.ones(8)
    with blas.capture_scope():
        for on in (True, True, False):
            monkeypatch.setattr(fp8_linear, "NO_CUBLASLT_WORKSPACE", on)
            fp8_linear._torch_gemm(a, sa, w, sw, None, None, 4, None, (4, 8), torch.float32)
    assert seen == [None, "0", None]
