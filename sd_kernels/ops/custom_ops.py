"""sd_kernels' ops as torch custom ops (``torch.ops.sd_kernels.*``), for torch.compile.

Each op the patch calls is registered with ``torch.library`` together with a fake (meta)
implementation that gives the output's shape, dtype and strides without running anything. Dynamo
records one opaque node per call instead of tracing into Triton launchers and dispatch logic, so a
patched UNet compiles with ``torch.compile(fullgraph=True)`` and no graph breaks.

Eager calls skip the dispatcher: the functions below (what the patched modules call) run the plain
Python op, and take the ``torch.ops`` route only while ``torch.compiler.is_compiling()``. The
dispatcher costs host time on every call (argument parsing against the schema, the dispatch keys);
tests/ops/test_custom_ops.py measures both routes and docs/patch.md gives the numbers.

Output strides: code that inductor generates after an op assumes the strides the fake promised, so
the real implementation must return exactly those. One ``*_layout`` function per op is that
promise, shared by fake and real; the real one re-lays its output (one copy) only where a fallback
path returned another layout.
"""

import functools
import importlib
from collections.abc import Callable

import torch

from sd_kernels import ops, reference
from sd_kernels.ops.layout import contiguous_strides, is_channels_last, is_dense

# sd_kernels.ops re-exports functions named like its submodules (ops.gelu is the function): import
# the modules by name.
attention_ops = importlib.import_module("sd_kernels.ops.attention")
fp8_ops = importlib.import_module("sd_kernels.ops.fp8_linear")
attention_fp8_ops = importlib.import_module("sd_kernels.ops.attention_fp8")
gelu_ops = importlib.import_module("sd_kernels.ops.gelu")
layer_norm_ops = importlib.import_module("sd_kernels.ops.layer_norm")
rope_ops = importlib.import_module("sd_kernels.ops.rope")
upsample_ops = importlib.import_module("sd_kernels.ops.upsample")
winograd_ops = importlib.import_module("sd_kernels.ops.winograd")

Layout = tuple[tuple[int, ...], tuple[int, ...]]


def dense_layout(x: torch.Tensor) -> Layout:
    """x's strides when x is non-overlapping and dense (channels_last stays so), else contiguous:
    the output layout of the normalisation and elementwise kernels."""
    shape = tuple(x.shape)
    return shape, tuple(x.stride()) if is_dense(x) else contiguous_strides(shape)


def halved_layout(h: torch.Tensor) -> Layout:
    """GEGLU: [..., 2n] → [..., n], contiguous."""
    shape = (*h.shape[:-1], h.shape[-1] // 2)
    return shape, contiguous_strides(shape)


def linear_geglu_layout(x: torch.Tensor, weight: torch.Tensor) -> Layout:
    shape = (*x.shape[:-1], weight.shape[0] // 2)
    return shape, contiguous_strides(shape)


def attention_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Layout:
    """[*batch, Sq, Dv]; for a 4-D q whose heads are inner in memory (diffusers' transposed views of
    [B, S, H, D]) that layout, so that the caller's transpose + reshape stays a view."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    shape = (*batch, q.shape[-2], v.shape[-1])
    if len(shape) == 4 and q.dim() == 4 and q.stride(1) < q.stride(2):
        _, h, s, d = shape
        return shape, (s * h * d, d, h * d, 1)
    return shape, contiguous_strides(shape)


def conv_layout(x: torch.Tensor, weight: torch.Tensor, scale: int = 1) -> Layout:
    """A 3×3 same-size conv (of x upsampled ``scale`` times): [N, K, scale·H, scale·W] in x's memory
    format (channels_last stays so)."""
    n, _, h, w = x.shape
    k, h, w = weight.shape[0], scale * h, scale * w
    shape = (n, k, h, w)
    return shape, (h * w * k, 1, w * k, k) if is_channels_last(x) else contiguous_strides(shape)


# Inductor hands a custom op its inputs in exactly the strides they had when traced: the layout the
# fake computed from them is then the one the real implementation computes at run time.
_TAGS = (torch.Tag.needs_exact_strides,)


def _empty(layout: Layout, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_strided(*layout, dtype=dtype or like.dtype, device=like.device)


def _promoted(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype torch's type promotion gives ``tensors`` (Nones skipped): what a reference computed
    op by op returns where the kernel refuses mixed dtypes."""
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors if t is not None])


def _relaid(out: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``out`` in ``layout``: itself when it already is (the kernels' case), else a copy."""
    if tuple(out.stride()) == layout[1] or out.numel() <= 1:
        return out
    return _empty(layout, out).copy_(out)


# ---------------------------------------------------------------------------------------------
# The custom ops: real implementation (the public op, output in the promised layout) and fake.


_REGISTERED: list[str] = []


def _custom_op(name: str, layout: Callable[..., Layout], outputs: int = 1,
               dtypes: Callable[..., tuple[torch.dtype, ...]] | None = None):
    """Register the decorated (typed) function as ``torch.ops.sd_kernels.<name>``: the real
    implementation returns its output in ``layout(*args)``, the fake an empty tensor in it, of the
    first argument's dtype or ``dtypes(*args)``'s (one per output); ``outputs > 1``: a tuple of that
    many outputs, each in that layout."""

    def register(fn):
        @functools.wraps(fn)
        def real(*args):
            lay = layout(*args)
            out = fn(*args)
            return _relaid(out, lay) if outputs == 1 else tuple(_relaid(o, lay) for o in out)

        def fake(*args):
            lay = layout(*args)
            kinds = dtypes(*args) if dtypes is not None else (args[0].dtype,) * outputs
            empties = tuple(_empty(lay, args[0], kind) for kind in kinds)
            return empties[0] if outputs == 1 else empties

        op = torch.library.custom_op(f"sd_kernels::{name}", real, mutates_args=(), tags=_TAGS)
        _REGISTERED.append(name)
        op.register_fake(fake)
        return op

    return register


@_custom_op("group_norm", lambda x, *_: dense_layout(x))
def _group_norm_op(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float, activation: str | None,
                   shift: torch.Tensor | None = None) -> torch.Tensor:
    return ops.group_norm(x, num_groups, weight, bias, eps, activation, shift=shift)


@_custom_op("gelu", lambda x, *_: dense_layout(x))
def _gelu_op(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return gelu_ops.gelu(x, approximate)


@_custom_op("quick_gelu", dense_layout)
def _quick_gelu_op(x: torch.Tensor) -> torch.Tensor:
    return gelu_ops.quick_gelu(x)


@_custom_op("geglu", lambda h, *_: halved_layout(h))
def _geglu_op(h: torch.Tensor, approximate: str) -> torch.Tensor:
    return gelu_ops.geglu(h, approximate)


@_custom_op("linear_geglu", lambda x, weight, *_: linear_geglu_layout(x, weight))
def _linear_geglu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     approximate: str) -> torch.Tensor:
    return gelu_ops.linear_geglu(x, weight, bias, approximate)


@_custom_op("attention", lambda q, k, v, *_: attention_layout(q, k, v))
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                  scale: float | None, upcast: bool, precision: str = "exact") -> torch.Tensor:
    return attention_ops.attention(q, k, v, attn_mask, scale, upcast, precision)


@_custom_op("attention_fp8", lambda q, k, v, *_: attention_layout(q, k, v))
def _attention_fp8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, qk: str,
                      pv: str) -> torch.Tensor:
    return attention_fp8_ops.attention_fp8(q, k, v, None, scale, qk, pv)


def contiguous_layout(x: torch.Tensor) -> Layout:
    shape = tuple(x.shape)
    return shape, contiguous_strides(shape)


def _modulated_dtypes(x, weight, bias, eps, scale, shift) -> tuple[torch.dtype]:
    return (_promoted(x, weight, bias, scale, shift),)


def _gated_dtypes(residual, branch, gate, weight, bias, eps, scale, shift) -> tuple[torch.dtype, torch.dtype]:
    h = _promoted(residual, branch, gate)
    return h, torch.promote_types(h, _promoted(residual, weight, bias, scale, shift))


@_custom_op("layer_norm_modulated", lambda x, *_: contiguous_layout(x), dtypes=_modulated_dtypes)
def _layer_norm_modulated_op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                             scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    return layer_norm_ops.layer_norm_modulated(x, weight, bias, eps, scale, shift)


@_custom_op("rms_norm", lambda x, *_: contiguous_layout(x),
            dtypes=lambda x, weight, eps: (reference.rms_norm_dtype(x, weight),))
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return layer_norm_ops.rms_norm(x, weight, eps)


@_custom_op("gated_residual_layer_norm", lambda residual, *_: contiguous_layout(residual), outputs=2,
            dtypes=_gated_dtypes)
def _gated_residual_layer_norm_op(
        residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None,
        bias: torch.Tensor | None, eps: float, scale: torch.Tensor | None,
        shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return layer_norm_ops.gated_residual_layer_norm(residual, branch, gate, weight, bias, eps, scale, shift)


@_custom_op("winograd_conv2d", lambda x, weight, *_: conv_layout(x, weight))
def _winograd_conv2d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        tile: int) -> torch.Tensor:
    # The transformed weights come from the cache of the patched conv that owns ``weight``.
    return winograd_ops.winograd_conv2d(x, winograd_ops.cached_weight(weight, tile), bias)


@_custom_op("upsample_conv2d", lambda x, weight, *_: conv_layout(x, weight, 2))
def _upsample_conv2d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The phases come from the cache of the patched upsampler that owns ``weight``.
    return upsample_ops.upsample_conv2d(x, weight, bias, cached=True)


# The FP8 ops return codes and scales of other shapes and dtypes than their input, qk_norm_rope two or three
# outputs of another shape: their own fakes.


def _own_fake_op(name: str, fake: Callable):
    def register(fn):
        op = torch.library.custom_op(f"sd_kernels::{name}", fn, mutates_args=(), tags=_TAGS)
        _REGISTERED.append(name)
        op.register_fake(fake)
        return op

    return register


def _codes_and_scales(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((*x.shape[:-1], n), dtype=fp8_ops.E4M3, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


@_own_fake_op("fp8_quantize_rows", lambda x, act, gated: _codes_and_scales(x, x.shape[-1] // (2 if gated else 1)))
def _fp8_quantize_op(x: torch.Tensor, act: str, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_ops.quantize_rows(x, act, gated)


@_own_fake_op("fp8_gemm", lambda a_q, s_a, w_q, *args: torch.empty((*a_q.shape[:-1], w_q.shape[0]), dtype=args[-1],
                                                               device=a_q.device))
def _fp8_gemm_op(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                 bias: torch.Tensor | None, act: str, gate: torch.Tensor | None, residual: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_ops.fp8_gemm(a_q, s_a, w_q, s_w, bias, act, gate, residual, out_dtype)


def _norm_fp8_fake(x, weight, bias, eps, scale, shift):
    return (torch.empty(x.shape, dtype=_promoted(x, weight, bias, scale, shift), device=x.device),
            *_codes_and_scales(x, x.shape[-1]))


@_own_fake_op("layer_norm_modulated_fp8", _norm_fp8_fake)
def _layer_norm_modulated_fp8_op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                                 eps: float, scale: torch.Tensor | None,
                                 shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer_norm_ops.layer_norm_modulated_fp8(x, weight, bias, eps, scale, shift)


def _joined_heads(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight):
    """qk_norm_rope's outputs: query and key [B, S_text + S, H, D], contiguous, and the joined values
    only with a text stream (without one the values are the caller's view of v, never an output)."""
    bsz, s, n = q.shape
    shape = (bsz, s + (0 if eq is None else eq.shape[1]), n // head_dim, head_dim)
    return [torch.empty(shape, dtype=q.dtype, device=q.device) for _ in range(2 if ev is None else 3)]


@_own_fake_op("qk_norm_rope", _joined_heads)
def _qk_norm_rope_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float | None, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, eq: torch.Tensor | None, ek: torch.Tensor | None,
                     ev: torch.Tensor | None, eq_weight: torch.Tensor | None,
                     ek_weight: torch.Tensor | None) -> list[torch.Tensor]:
    out = rope_ops.qk_norm_rope(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight,
                                ek_weight)[:2 if ev is None else 3]
    # a custom op's outputs are fresh and in the fake's layout: the reference's views (no norm, no rotation)
    # and its other layouts (a norm of a strided slice) are copied
    return [t if t._base is None and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
            for t in out]


# ---------------------------------------------------------------------------------------------
# What patched modules call: the plain op in eager, the custom op while compiling.


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, activation=None, shift=None):
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.group_norm(x, num_groups, weight, bias, float(eps), activation, shift)
    return ops.group_norm(x, num_groups, weight, bias, eps, activation, shift=shift)


def gelu(x, approximate="none"):
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.gelu(x, approximate)
    return gelu_ops.gelu(x, approximate)


def quick_gelu(x):
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.quick_gelu(x)
    return gelu_ops.quick_gelu(x)


def geglu(h, approximate="none"):
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.geglu(h, approximate)
    return gelu_ops.geglu(h, approximate)


def linear_geglu(x, weight, bias=None, approximate="none"):
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.linear_geglu(x, weight, bias, approximate)
    return gelu_ops.linear_geglu(x, weight, bias, approximate)


def linear_gelu(x, weight, bias=None, approximate="none"):
    """gelu(x·Wᵀ + b): cuBLASLt's GELU epilogue where it applies (plain ATen, traced as such by
    torch.compile), else cuBLAS's linear and ``gelu`` above (``sd_kernels.ops.gelu.linear_gelu``)."""
    return gelu_ops.linear_gelu(x, weight, bias, approximate, activation=gelu)


def attention(q, k, v, attn_mask=None, scale=None, upcast=False, precision="exact", kv_stats=None):
    """``sd_kernels.ops.attention.attention``; ``precision="fp8"`` routes the calls the FP8 kernel takes
    to it (``ops.attention.fp8_reason``). ``kv_stats`` (eager calls; a compiled graph computes its own)."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.attention(q, k, v, attn_mask, None if scale is None else float(scale), upcast,
                                              precision)
    return attention_ops.attention(q, k, v, attn_mask, scale, upcast, precision, kv_stats)


def attention_fp8(q, k, v, scale=None, qk="int8", pv="fp8"):
    """``sd_kernels.ops.attention_fp8`` (no mask)."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.attention_fp8(q, k, v, None if scale is None else float(scale), qk, pv)
    return attention_fp8_ops.attention_fp8(q, k, v, None, scale, qk, pv)


def layer_norm_modulated(x, weight=None, bias=None, eps=1e-6, scale=None, shift=None):
    """LayerNorm with adaLN modulation: ``sd_kernels.ops.layer_norm_modulated``."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.layer_norm_modulated(x, weight, bias, float(eps), scale, shift)
    return layer_norm_ops.layer_norm_modulated(x, weight, bias, eps, scale, shift)


def rms_norm(x, weight=None, eps=1e-6):
    """T5's RMSNorm: ``sd_kernels.ops.layer_norm.rms_norm``."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.rms_norm(x, weight, float(eps))
    return layer_norm_ops.rms_norm(x, weight, eps)


def gated_residual_layer_norm(residual, branch, gate=None, weight=None, bias=None, eps=1e-6, scale=None, shift=None):
    """(residual + gate·branch, its modulated LayerNorm): ``sd_kernels.ops.gated_residual_layer_norm``."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.gated_residual_layer_norm(residual, branch, gate, weight, bias, float(eps),
                                                              scale, shift)
    return layer_norm_ops.gated_residual_layer_norm(residual, branch, gate, weight, bias, eps, scale, shift)


def winograd_conv2d(x, weight, bias, tile):
    """3×3 conv of ``weight`` as Winograd F(tile, 3); the transformed weights are cached by the
    patched conv that owns ``weight`` (sd_kernels.ops.winograd.WeightCache)."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.winograd_conv2d(x, weight, bias, int(tile))
    return winograd_ops.winograd_conv2d(x, winograd_ops.cached_weight(weight, tile), bias)


def upsample_conv2d(x, weight, bias):
    """Nearest-2× + 3×3 conv as the polyphase 2×2 conv; the phases are cached by the patched
    upsampler that owns ``weight`` (sd_kernels.ops.upsample.PhaseCache)."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.upsample_conv2d(x, weight, bias)
    return upsample_ops.upsample_conv2d(x, weight, bias, cached=True)


def fp8_quantize_rows(x, act="", gated=False):
    """FP8 codes and row scales of ``act(x)``: ``sd_kernels.ops.quantize_rows``."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.fp8_quantize_rows(x, act, gated)
    return fp8_ops.quantize_rows(x, act, gated)


def fp8_gemm(a_q, s_a, w_q, s_w, bias=None, act="", gate=None, residual=None, out_dtype=torch.bfloat16):
    """The row-scaled FP8 GEMM with its epilogue: ``sd_kernels.ops.fp8_gemm``."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.fp8_gemm(a_q, s_a, w_q, s_w, bias, act, gate, residual, out_dtype)
    return fp8_ops.fp8_gemm(a_q, s_a, w_q, s_w, bias, act, gate, residual, out_dtype)


def fp8_linear(x, w_q, s_w, bias=None, act="", gate=None, residual=None, table=None):
    """x quantized per row (or the quantization it carries, in eager), then ``fp8_gemm``:
    ``sd_kernels.ops.fp8_linear``. Compiled graphs quantize each call's input (no attached codes) and serve no
    rows from a ``table``."""
    if torch.compiler.is_compiling():
        q, s = torch.ops.sd_kernels.fp8_quantize_rows(x, "", False)
        return torch.ops.sd_kernels.fp8_gemm(q, s, w_q, s_w, bias, act, gate, residual, x.dtype)
    return fp8_ops.fp8_linear(x, w_q, s_w, bias, act, gate, residual, table=table)


def layer_norm_modulated_fp8(x, weight=None, bias=None, eps=1e-6, scale=None, shift=None, values=True):
    """(modulated LayerNorm, its FP8 codes, row scales): ``sd_kernels.ops.layer_norm_modulated_fp8``; ``values``
    False (eager calls; a traced call writes them): the LayerNorm a NaN stand-in (``ops.layer_norm.unwritten``)."""
    if torch.compiler.is_compiling():
        return torch.ops.sd_kernels.layer_norm_modulated_fp8(x, weight, bias, float(eps), scale, shift)
    return layer_norm_ops.layer_norm_modulated_fp8(x, weight, bias, eps, scale, shift, values=values)


def qk_norm_rope(q, k, v, head_dim, q_weight=None, k_weight=None, eps=None, cos=None, sin=None, eq=None, ek=None,
                 ev=None, eq_weight=None, ek_weight=None):
    """FLUX's attention inputs (q/k RMSNorm, text + image join, rotary embedding): ``sd_kernels.ops.qk_norm_rope``."""
    if torch.compiler.is_compiling():
        out = torch.ops.sd_kernels.qk_norm_rope(q, k, v, int(head_dim), q_weight, k_weight,
                                                None if eps is None else float(eps), cos, sin, eq, ek, ev,
                                                eq_weight, ek_weight)
        return out[0], out[1], v.unflatten(-1, (-1, head_dim)) if ev is None else out[2]
    return rope_ops.qk_norm_rope(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight,
                                 ek_weight)


def qk_norm_rope_kv(q, k, v, head_dim, q_weight=None, k_weight=None, eps=None, cos=None, sin=None, eq=None, ek=None,
                    ev=None, eq_weight=None, ek_weight=None, kv_out=None):
    """``sd_kernels.ops.qk_norm_rope_kv``: (query, kv [B, S, 2, H, D]), into ``kv_out`` where given; traced,
    ``qk_norm_rope``'s op and a stack (``kv_out`` not taken)."""
    args = (q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight)
    if torch.compiler.is_compiling():
        if kv_out is not None:
            raise ValueError("qk_norm_rope_kv: kv_out is not taken under torch.compile")
        query, key, value = qk_norm_rope(*args)
        return query, rope_ops.kv_layout(key, value)
    return rope_ops.qk_norm_rope_kv(*args, kv_out=kv_out)


def qk_norm_rope_fp8(q, k, v, head_dim, q_weight=None, k_weight=None, eps=None, cos=None, sin=None, eq=None,
                     ek=None, ev=None, eq_weight=None, ek_weight=None):
    """``sd_kernels.ops.rope.qk_norm_rope_fp8``: (query, key, value, the FP8 attention's K/V statistics); traced,
    ``qk_norm_rope``'s op and no statistics (the compiled attention computes its own)."""
    args = (q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight)
    if torch.compiler.is_compiling():
        return (*qk_norm_rope(*args), None)
    return rope_ops.qk_norm_rope_fp8(*args)


OPS = tuple(_REGISTERED)  # torch.ops.sd_kernels.*, as registered above
