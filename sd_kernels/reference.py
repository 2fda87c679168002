"""Plain-PyTorch versions of every op sd-kernels implements.

Each function here has exactly the contract of the kernel of the same name in ``sd_kernels.ops``.
They serve twice: as the oracle in tests (run on float64 copies of the inputs) and as the fallback
that dispatch uses wherever a Triton kernel cannot run (CPU without the interpreter, shapes off a
kernel's ground). Nothing here is clever on purpose.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")
GELU_APPROXIMATIONS = ("none", "tanh")


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def check_gelu_approximation(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
    *,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.group_norm`` followed by an optional activation (``"silu"``); with ``shift`` ([N, C]), of
    x + shift[:, :, None, …] summed in the wider of the two dtypes, the result in x's."""
    check_activation(activation)
    if shift is not None:
        dtype = x.dtype
        x = x + shift.view(*shift.shape, *(1,) * (x.dim() - 2))
        weight, bias = (None if t is None else t.to(x.dtype) for t in (weight, bias))
        return group_norm(x, num_groups, weight, bias, eps, activation).to(dtype)
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y


def group_stats(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(count, mean, M2) per (sample, group), float64 [3, N, G] (ops.group_norm.group_stats)."""
    g = x.detach().reshape(x.shape[0], num_groups, -1).double()
    mean = g.mean(-1)
    return torch.stack([torch.full_like(mean, g.shape[-1]), mean, ((g - mean[..., None]) ** 2).sum(-1)])


def group_norm_given(x: torch.Tensor, stats: torch.Tensor, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, activation: str | None = None,
                     shift: torch.Tensor | None = None) -> torch.Tensor:
    """act((x [+ shift[:, :, None, …]] − mean)·rstd·w + b) with given [2, N, G] (mean, rstd), in fp32,
    output in x's dtype."""
    check_activation(activation)
    mean, rstd = stats.to(x.device, torch.float32)
    n, c = x.shape[:2]
    shape = (1, c) + (1,) * (x.dim() - 2)
    xf = x.float() if shift is None else x.float() + shift.float().view(n, c, *shape[2:])
    y = ((xf.reshape(n, mean.shape[-1], -1) - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if weight is not None:
        y = y * weight.float().view(shape)
    if bias is not None:
        y = y + bias.float().view(shape)
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)


def gated_add(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate · y as diffusers' DiT blocks write their gated residuals: the product rounded to the dtype,
    then the sum."""
    return x + gate * y


def bias_residual(y: torch.Tensor, bias: torch.Tensor, skip: torch.Tensor | None = None,
                  bias2: torch.Tensor | None = None, divisor: float = 1.0) -> torch.Tensor:
    """(y + bias[c] [+ bias2[c]] [+ skip]) / divisor, in fp32 (float64 for float64 y), in y's dtype and layout."""
    wide = torch.float64 if y.dtype == torch.float64 else torch.float32
    shape = (1, -1) + (1,) * (y.dim() - 2)
    v = y.to(wide) + bias.to(wide).view(shape)
    if bias2 is not None:
        v = v + bias2.to(wide).view(shape)
    if skip is not None:
        v = v + skip.to(wide)
    return (v / divisor).to(y.dtype)


# A row or group whose largest magnitude is at most this (2⁻¹¹⁹, 1.5e-36) is quantized as zeros beside its
# scale, by every 8-bit quantization here and in its kernels: 448 / max|v| overflows fp32 below 1.32e-36 (127 /
# max|v| below 3.7e-37), and 0 · inf would make NaN codes of a finite row. Its products are below 1e-35 of
# the other operand's magnitude.
SCALE_TINY = 2.0**-119


def inverse_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """qmax / amax in fp32, 0 where amax is at most SCALE_TINY: a tensor divided, not ``qmax / amax`` (torch
    computes a scalar over a tensor as a reciprocal times the scalar, which rounds twice), as the kernels'
    IEEE division rounds it."""
    return torch.where(amax > SCALE_TINY, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))


def pack8(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """ops.pack8: x [N, C, H, W] as int8 codes round(x · 127 / max|x|) per pixel and group of
    channels (``values`` [N, H, W, C]) and the group's max|x| / 127 (``scales`` [N, H, W, C / G]); a
    group with a non-finite value: codes 0, scale NaN."""
    g = x.shape[1] // scales.shape[-1]
    v = x.permute(0, 2, 3, 1).float().unflatten(-1, (-1, g))
    bad = ~torch.isfinite(v).all(-1)
    amax = v.abs().amax(-1)
    inv = torch.where(amax > SCALE_TINY, 127.0 / amax, torch.zeros_like(amax))
    q = torch.floor(v * inv.unsqueeze(-1) + 0.5).clamp(-127, 127).masked_fill(bad.unsqueeze(-1), 0)
    values.copy_(q.flatten(-2).to(torch.int8))
    scales.copy_((amax / 127.0).masked_fill(bad, float("nan")))


def unpack8(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """ops.unpack8: codes · scale (fp32, rounded once) into ``out`` [N, C, H, W]; returns out."""
    g = values.shape[-1] // scales.shape[-1]
    y = values.float().unflatten(-1, (-1, g)) * scales.unsqueeze(-1)
    return out.copy_(y.flatten(-2).permute(0, 3, 1, 2))


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    check_gelu_approximation(approximate)
    return F.gelu(x, approximate=approximate)


def check_geglu_input(h: torch.Tensor) -> None:
    """What GEGLU's ``h.chunk(2, -1)`` needs: a dimension to split (torch's words), an even one."""
    if h.dim() == 0:
        raise RuntimeError("chunk expects at least a 1-dimensional tensor")
    if h.shape[-1] % 2:
        raise ValueError(f"geglu needs an even last dimension, got {h.shape[-1]}")


def geglu(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """diffusers' GEGLU after its projection: ``a * gelu(gate)`` with ``a, gate = h.chunk(2, -1)``."""
    check_gelu_approximation(approximate)
    check_geglu_input(h)
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate, approximate=approximate)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check_layer_norm_args(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    **modulation: torch.Tensor | None,
) -> None:
    """What ``layer_norm_modulated`` and ``gated_residual_layer_norm`` take: x [B, T, D], an affine
    weight and bias of shape [D] (torch's message for F.layer_norm), and per-sample modulation tensors
    (scale, shift, gate) of shape [B, D] or [B, 1, D], B also 1 (broadcast over the batch)."""
    if x.dim() != 3:
        raise ValueError(f"{op} needs a 3-D input [B, T, D], got shape {_shape(x)}")
    b, d = x.shape[0], x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and _shape(t) != [d]:
            raise RuntimeError(  # F.layer_norm's own words
                f"Expected {name} to be of same shape as normalized_shape, but got {name} of shape {_shape(t)} "
                f"and normalized_shape = [{d}]"
            )
    for name, t in modulation.items():
        if t is None:
            continue
        ok = (t.dim() == 2 or (t.dim() == 3 and t.shape[1] == 1)) and t.shape[0] in (b, 1) and t.shape[-1] == d
        if not ok:
            raise ValueError(
                f"{op}: {name} must have shape [B, D] or [B, 1, D] with B = {b} (or 1) and D = {d}, "
                f"got {_shape(t)}"
            )


def check_gated_residual_args(residual, branch, gate, weight, bias, scale, shift) -> None:
    """``check_layer_norm_args`` for the residual, and a branch of exactly its shape (no broadcast)."""
    check_layer_norm_args("gated_residual_layer_norm", residual, weight, bias, gate=gate, scale=scale, shift=shift)
    if branch.shape != residual.shape:
        raise ValueError(f"gated_residual_layer_norm: branch must have the residual's shape {_shape(residual)}, "
                         f"got {_shape(branch)}")


def _per_sample(m: torch.Tensor) -> torch.Tensor:
    """A modulation tensor [B, D] or [B, 1, D] as [B, 1, D], broadcasting over the tokens."""
    return m if m.dim() == 3 else m.unsqueeze(1)


def layer_norm_modulated(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """adaLN: ``F.layer_norm(x, [D], weight, bias, eps) * (1 + scale) + shift`` over x [B, T, D] with
    per-sample scale and shift [B, D] or [B, 1, D] (either may be None), as PixArt's and SD3's blocks
    write it: one torch op at a time, each rounded to x's dtype."""
    check_layer_norm_args("layer_norm_modulated", x, weight, bias, scale=scale, shift=shift)
    y = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if scale is not None:
        y = y * (1 + _per_sample(scale))
    if shift is not None:
        y = y + _per_sample(shift)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """T5's LayerNorm as transformers writes it (``T5LayerNorm.forward``): the mean of squares in fp32,
    the normalized x rounded to a half-precision weight's dtype, then times the weight (so the result is
    in a half weight's dtype, else fp32); without a weight, in x's dtype."""
    check_layer_norm_args("rms_norm", x, weight, None)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight is None:
        return y.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return weight * y


def rms_norm_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype ``rms_norm`` returns."""
    if weight is None:
        return x.dtype
    if weight.dtype in (torch.float16, torch.bfloat16):
        return weight.dtype
    return torch.promote_types(weight.dtype, torch.float32)


def gated_residual_layer_norm(
    residual: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DiT block's gated residual and the next adaLN: ``h = residual + gate * branch`` (gate None: 1),
    returned with ``layer_norm_modulated(h, weight, bias, eps, scale, shift)``."""
    check_gated_residual_args(residual, branch, gate, weight, bias, scale, shift)
    h = gated_residual(residual, branch, gate)
    return h, layer_norm_modulated(h, weight, bias, eps, scale, shift)


def gated_residual(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``residual + gate * branch`` (gate [B, D] or [B, 1, D] per sample; None: 1), as stock computes it."""
    return residual + (branch if gate is None else _per_sample(gate) * branch)


def default_scale(head_dim: int) -> float:
    """SDPA's default scale 1/√D; inf at D = 0, as torch computes it."""
    return 1.0 / math.sqrt(head_dim) if head_dim else math.inf


def _additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean masks (True = attend) become 0 / -inf, as in ``F.scaled_dot_product_attention``."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
        ~attn_mask, float("-inf")
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive ``softmax(q kᵀ · scale + mask) v``: the Sq×Sk scores are materialised, in float32 for
    half-precision inputs (as SDPA and the kernels accumulate them: fp16 scores past 65504 would be
    inf, then NaN).

    Rows whose every key is masked out produce zeros (not NaN), the behaviour the kernels share; a
    NaN anywhere else (a NaN input, say) stays NaN, as in torch.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    mask = _additive_mask(attn_mask, scores.dtype)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    return (probs @ v.to(probs.dtype)).to(v.dtype)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch's fused attention, the stock path of diffusers' ``AttnProcessor2_0``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scale · q kᵀ) v in q's dtype, the rows' log-sum-exp of scale · q kᵀ in float32) on
    [B, H, S, D], computed in float32 (float64 stays float64)."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(wide)
    return out.to(q.dtype), lse.to(torch.float32 if wide == torch.float32 else wide)


def merge_attention(a: tuple[torch.Tensor, torch.Tensor],
                    b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over two parts' keys from each part's (out [B, H, S, D], lse [B, H, S]):
    lse = logaddexp(lse_a, lse_b), out = exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b, in float32 (float64
    stays float64); a row with no key in either part (both −∞) gives 0 and −∞."""
    (oa, la), (ob, lb) = a, b
    wide = torch.float64 if torch.float64 in (oa.dtype, la.dtype) else torch.float32
    la, lb = la.to(wide), lb.to(wide)
    lse = torch.logaddexp(la, lb)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # no key in either part: the output 0
    out = torch.exp(la - finite).unsqueeze(-1) * oa.to(wide) + torch.exp(lb - finite).unsqueeze(-1) * ob.to(wide)
    return out, lse


def softmax_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``softmax(x, -1) @ w`` for x [..., a, b] and w [..., b, c]; softmax(x) is materialised here."""
    return torch.softmax(x, dim=-1) @ w


def conv2d_3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """3×3 convolution, stride 1, padding 1: the convs Winograd replaces."""
    if tuple(weight.shape[-2:]) != (3, 3):
        raise ValueError(f"conv2d_3x3 needs a 3x3 kernel, got {tuple(weight.shape[-2:])}")
    return F.conv2d(x, weight, bias, stride=1, padding=1)


def upsample_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest-neighbour 2× upsampling, then a 3×3 convolution with padding 1: diffusers'
    ``Upsample2D`` with its conv, as it runs it (``F.interpolate(..., scale_factor=2.0, mode="nearest")``)."""
    return conv2d_3x3(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1,
           padding=0) -> torch.Tensor:
    """``F.conv2d`` with groups 1 and dilation 1: what ``ops.conv.conv2d`` computes."""
    return F.conv2d(x, weight, bias, stride=stride, padding=padding)


def upcast(*tensors: torch.Tensor | None, dtype: torch.dtype = torch.float64) -> tuple:
    """Detached copies in ``dtype`` (default float64) for building oracles; None stays None."""
    return tuple(None if t is None else t.detach().to(dtype) for t in tensors)


# ---------------------------------------------------------------------------------------------
# FP8 (E4M3) row-scaled linear: the quantized math the kernels of ops/fp8_quant.py and ops/fp8_linear.py compute.

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
FP8_ACTIVATIONS = ("", "tanh", "none")  # before quantizing / in the epilogue: identity, tanh GELU, erf GELU


def check_fp8_activation(act: str) -> None:
    if act not in FP8_ACTIVATIONS:
        raise ValueError(f"act must be one of {FP8_ACTIVATIONS} ('' = none, 'tanh' / 'none' = GELU), got {act!r}")


def _activation(x: torch.Tensor, act: str) -> torch.Tensor:
    return x if act == "" else F.gelu(x, approximate=act)


def fp8_quantize_rows(x: torch.Tensor, act: str = "", gated: bool = False,
                      prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of x [..., N]: v = act(x) (gated: a · act(g) with a, g = x.chunk(2, -1)),
    computed in float32, with ``prefix`` [..., P] (as it is, no activation) in front of it where given;
    scale = max|v| / 448; q = e4m3(v · (448 / max|v|)). Returns (q [..., P + n] float8_e4m3fn, scale
    [...] float32); a row of zeros gets scale 0 and codes 0, a row no larger than SCALE_TINY codes 0."""
    check_fp8_activation(act)
    v = x.float()
    if gated:
        a, g = v.chunk(2, dim=-1)
        v = a * _activation(g, act)
    else:
        v = _activation(v, act)
    if prefix is not None:
        v = torch.cat([prefix.float(), v], dim=-1)
    amax = v.abs().amax(dim=-1, keepdim=True) if v.shape[-1] else v.new_zeros((*v.shape[:-1], 1))
    q = (v * inverse_scale(amax, E4M3_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (amax / E4M3_MAX).squeeze(-1)


def fp8_gemm(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
             bias: torch.Tensor | None = None, act: str = "", gate: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             compute: torch.dtype = torch.float32) -> torch.Tensor:
    """``y = (a_q · w_qᵀ) · s_a[:, None] · s_w[None, :]``, then ``+ bias``, ``act``, ``· gate`` (per
    sample: [B, N] or [B, 1, N], the rows of a_q split evenly over B), ``+ residual``, computed in
    ``compute`` and stored in ``out_dtype``. a_q [..., K] and w_q [N, K] float8_e4m3fn; s_a [...], s_w [N] float32."""
    y = (a_q.to(compute) @ w_q.to(compute).t()) * s_a.to(compute)[..., None] * s_w.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    y = _activation(y, act)
    if gate is not None:
        b, n = gate.shape[0], y.shape[-1]
        y = (y.reshape(b, -1, n) * gate.to(compute).reshape(b, 1, n)).reshape(y.shape)
    if residual is not None:
        y = y + residual.to(compute)
    return y.to(out_dtype)


def fp8_gemm_geglu(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, s_w: torch.Tensor,
                   bias: torch.Tensor | None = None, act: str = "none", out_dtype: torch.dtype = torch.float16,
                   compute: torch.dtype = torch.float32) -> torch.Tensor:
    """GEGLU of an FP8 projection: ``y = fp8_gemm(a_q, s_a, w_q, s_w, bias)`` kept in ``compute``, then
    ``a · gelu(g)`` with a, g = y.chunk(2, -1), stored in ``out_dtype`` (a and g are not rounded first).
    w_q [2F, K], the a half's rows first (nn.Linear's layout of diffusers' GEGLU projection)."""
    y = fp8_gemm(a_q, s_a, w_q, s_w, bias, out_dtype=compute, compute=compute)
    a, g = y.chunk(2, dim=-1)
    return (a * F.gelu(g, approximate=act)).to(out_dtype)


FP8_KEY_BLOCK = 128  # keys per K scale in ops.attention_fp8 (and its kernel's key block)


def e4m3_scaled(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x·(448/amax) rounded to float8_e4m3fn, in fp32 (0 where amax is at most SCALE_TINY): the kernels' quantization,
    each step an fp32 operation rounded as theirs is."""
    return (x * inverse_scale(amax, E4M3_MAX)).to(torch.float8_e4m3fn)


def int8_scaled(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x·(127/amax) rounded to the nearest integer (ties to even) as int8 (0 where amax is at most SCALE_TINY)."""
    return torch.round(x * inverse_scale(amax, 127.0)).to(torch.int8)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  qk: str = "int8", pv: str = "fp8", key_block: int = FP8_KEY_BLOCK) -> torch.Tensor:
    """``ops.attention_fp8``'s quantized algorithm, step by step; after the quantization (in fp32, as
    the kernel rounds it) everything runs in float64.

    Q per query row and K per block of ``key_block`` keys, after subtracting K's per-channel mean over
    the keys (softmax is unchanged by it), scaled to ±127 and rounded to int8 (``qk="int8"``) or to ±448
    and rounded to e4m3 (``qk="fp8"``); scores from the 8-bit values times the scales; the online
    softmax over key blocks in order, as the kernel runs it: the probabilities of each block,
    exp(s − running max) ∈ [0, 1], times 448 rounded to e4m3 for ``pv="fp8"`` (V per channel scaled to
    ±448 and rounded to e4m3), or P and V in the input dtype for ``pv="input"``; the row sum from the
    unrounded probabilities.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    f64 = torch.float64
    q32, k32 = q.float(), k.float()
    quantized, qmax = (int8_scaled, 127.0) if qk == "int8" else (e4m3_scaled, E4M3_MAX)
    q8 = quantized(q32, q32.abs().amax(-1, keepdim=True))
    q_scale = q32.abs().amax(-1, keepdim=True).to(f64) / qmax
    kc = k32 - k32.sum(-2, keepdim=True) / k.shape[-2]
    sk = k.shape[-2]
    blocks = range(0, sk, key_block)
    log2e = 1.0 / math.log(2.0)
    rows = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]), q.shape[-2])
    m = torch.full((*rows, 1), -math.inf, dtype=f64, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros((*rows, v.shape[-1]), dtype=f64, device=q.device)
    if pv == "fp8":
        v_amax = v.float().abs().amax(-2, keepdim=True)
        v_all = e4m3_scaled(v.float(), v_amax).to(f64)
    else:
        v_all = v.to(f64)
    for n0 in blocks:
        kb = kc[..., n0:n0 + key_block, :]
        k_amax = kb.abs().amax((-1, -2), keepdim=True)
        k8 = quantized(kb, k_amax)
        s = q8.to(f64) @ k8.to(f64).transpose(-1, -2) * (q_scale * (k_amax.to(f64) / qmax) * scale * log2e)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp2(s - m_new)
        alpha = torch.exp2(m - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        if pv == "fp8":
            p = (p * E4M3_MAX).to(torch.float8_e4m3fn).to(f64) / E4M3_MAX
        else:
            p = p.to(q.dtype).to(f64)
        acc = acc * alpha + p @ v_all[..., n0:n0 + key_block, :]
        m = m_new
    out = acc / l
    if pv == "fp8":
        out = out * (v_amax.to(f64) / E4M3_MAX)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# FLUX's attention inputs: q/k RMSNorm, the text + image join, the rotary embedding (ops/rope.py).


def check_qk_norm_rope_args(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight,
                            ek_weight) -> None:
    """What ``qk_norm_rope`` takes: q, k, v [B, S, H·D] of one shape; the text stream's eq, ek, ev all
    given ([B, S_text, H·D]) or none; norm weights [D] only with a norm (``eps`` set); cos and sin both
    [S_text + S, D] or neither, D even with them (the rotation pairs neighbours)."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"qk_norm_rope: q, k, v must be [B, S, H·D] of one shape, got {_shape(q)}, {_shape(k)}, "
                         f"{_shape(v)}")
    if head_dim < 1 or q.shape[-1] % head_dim:
        raise ValueError(f"qk_norm_rope: head_dim {head_dim} does not divide the projections' width {q.shape[-1]}")
    text = (eq, ek, ev)
    if any(t is None for t in text) != all(t is None for t in text):
        raise ValueError("qk_norm_rope: the text stream needs all of eq, ek, ev (or none)")
    if eq is not None and any(t.dim() != 3 or t.shape[0] != q.shape[0] or t.shape[-1] != q.shape[-1]
                              or t.shape != eq.shape for t in text):
        raise ValueError(f"qk_norm_rope: eq, ek, ev must be [B, S_text, H·D] of one shape with B = {q.shape[0]} "
                         f"and H·D = {q.shape[-1]}, got {_shape(eq)}, {_shape(ek)}, {_shape(ev)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight), ("eq_weight", eq_weight),
                    ("ek_weight", ek_weight)):
        if w is not None and (eps is None or _shape(w) != [head_dim]):
            raise ValueError(f"qk_norm_rope: {name} must be [{head_dim}] with a norm (eps set), got {_shape(w)} "
                             f"with eps={eps}")
    if (cos is None) != (sin is None):
        raise ValueError("qk_norm_rope: the rotary embedding needs both cos and sin")
    s_total = q.shape[1] + (0 if eq is None else eq.shape[1])
    if cos is not None and (_shape(cos) != [s_total, head_dim] or _shape(sin) != [s_total, head_dim]
                            or head_dim % 2):
        raise ValueError(f"qk_norm_rope: cos and sin must be [{s_total}, {head_dim}] with an even head dim, "
                         f"got {_shape(cos)}, {_shape(sin)}")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` (``use_real``, pairs (x[2i], x[2i+1])):
    x·cos + turned·sin with turned[2i] = −x[2i+1], turned[2i+1] = x[2i], for x [B, S, H, D] and cos, sin
    [S, D]; in fp32 (float64 for float64 x), the result in x's dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    turned = torch.stack([-odd, even], dim=-1).flatten(-2)
    cos, sin = cos[None, :, None, :].to(x.device), sin[None, :, None, :].to(x.device)
    return (x.to(wide) * cos + turned.to(wide) * sin).to(x.dtype)


def qk_norm_rope(q, k, v, head_dim, q_weight=None, k_weight=None, eps=None, cos=None, sin=None, eq=None, ek=None,
                 ev=None, eq_weight=None, ek_weight=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What diffusers' FluxAttnProcessor does between its projections and the attention, in its order:
    each stream's q, k, v [B, S, H·D] as [B, S, H, D] heads; q and k through ``torch.nn.RMSNorm``'s
    ``F.rms_norm`` over D (with eps set; weights per stream, None for none); the text stream (eq, ek,
    ev) concatenated in front of the image's; q and k rotated by ``rotary`` (cos, sin given). Returns
    (query, key, value) [B, S_text + S, H, D]; without a text stream value is v's view."""
    check_qk_norm_rope_args(q, k, v, head_dim, q_weight, k_weight, eps, cos, sin, eq, ek, ev, eq_weight, ek_weight)

    def heads(t):
        return t.unflatten(-1, (-1, head_dim))

    def norm(t, weight):
        return heads(t) if eps is None else F.rms_norm(heads(t), (head_dim,), weight, eps)

    query, key, value = norm(q, q_weight), norm(k, k_weight), heads(v)
    if eq is not None:
        query = torch.cat([norm(eq, eq_weight), query], dim=1)
        key = torch.cat([norm(ek, ek_weight), key], dim=1)
        value = torch.cat([heads(ev), value], dim=1)
    if cos is not None:
        query, key = rotary(query, cos, sin), rotary(key, cos, sin)
    return query, key, value
