"""``patch(pipe, precision="fp8")``: the transformer blocks' linear layers as FP8 (E4M3) GEMMs.

Lossy and opt-in (docs/fp8.md). Inside every transformer block the patch knows (FLUX's double- and
single-stream blocks, SD3's joint blocks, PixArt's and the UNets' ``BasicTransformerBlock``), each
exact ``nn.Linear`` becomes an ``Fp8Linear``: its weight quantized once, here, with one scale per
output channel; its input quantized per row (token) on every call. Where the block's structure is
known, the quantization moves into the op that produces the input:

| module (diffusers 0.42.1)             | here                                                        |
|---------------------------------------|-------------------------------------------------------------|
| ``FeedForward`` (GELU tanh/erf, GEGLU) | GEMM 1 → one kernel: GELU (GEGLU) + row quantization → GEMM 2 |
|                                       | (opt-in, ``fp8_geglu.GEGLU_EPILOGUE``: GEMM 1 writes the      |
|                                       | GEGLU's a · gelu(g), then the row quantization; measured      |
|                                       | slower in SDXL's step: ops/fp8_geglu.py)                      |
| ``AdaLayerNormZero`` / ``…Single``      | the modulated LayerNorm writes its FP8 codes in the same pass, |
|                                       | and attention's q, k, v projections read them                |
| a UNet block's ``nn.LayerNorm``s       | the LayerNorm writes its FP8 codes in the same pass          |
| (``norm1``-``norm3``, SD's and SDXL's)  | (``Fp8LayerNorm``), which the projections after it read;     |
|                                       | norm2's and norm3's kernel also makes the residual add       |
|                                       | before them (patches/unet_blocks.py)                         |
| any other ``nn.Linear`` in a block    | quantize the input (once per input tensor) → GEMM             |

The block forwards of patches/layer_norm.py (FLUX's, SD3's) go further where they call these: a
single block's attention output and GELU(``proj_mlp``) are quantized together for ``proj_out``
(``Fp8Linear.joined``: the concatenation never written), and its gated residual and the
feed-forwards' (``Fp8FeedForward.gated_residual``) are the GEMM's epilogue (on Hopper in bf16, where
torch's ``_scaled_mm`` serves the GEMM, one pass after it: ops/fp8_linear.py).

The projections of one input (q, k and v of the same hidden states; k and v of the same text
context, block after block) share one quantization: the first one leaves it on the tensor
(``ops.fp8_linear.attach_quantized``). Where the attention patcher laid an attention's q, k and v weights out
in one buffer (patches/qkv_fusion.py: FLUX's, SD3's, the UNets' and PixArt-Σ's self-attentions), their codes and
scales are laid out alike and the three are one GEMM (``Fp8Projections``; SD3's writes the streams' join in place,
patches/joint_attention.py). A cross-attention's key and value projections read the text, a few hundred rows a
call: they stay in the model's dtype (``CROSS_KV_FP8``).
Outside the blocks (embedders, the final norm and projection, 1×1 convolutions: their GEMMs are a small
share of a step) nothing changes.

Attention runs FP8 at the head dims in ``FP8_ATTENTION`` (128: FLUX's), where the FP8 attention kernel
(docs/kernels/attention_fp8.md) measured faster than our exact attention on the H200; at 64 (SD3's, SDXL's)
it is slower and stays exact (docs/fp8.md). The processors the attention patcher installed inside the same
blocks (patches/attention.py ``PRECISION_PROCESSORS``: the UNets' and PixArt's, SD3's joint, FLUX's) whose
attention has such a head dim get ``precision="fp8"``, which they hand to the attention op; the op runs the
calls its FP8 kernel takes there and the rest exactly.

Exactly reversible: the replacements hold the original Parameters themselves (state_dict keys and
values unchanged) and the FP8 codes beside them, so the original weights stay on the device while
patched (the record says what that costs); ``unpatch`` puts the very modules back. A weight changed
while patched (an assigned Parameter, ``weight.data = ...``, ``.to(dtype)``, an in-place update) is
quantized again at the next call (``Fp8Linear.fresh``), except in place through ``weight.data`` and
inside a compiled graph (docs/fp8.md).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import torch
import torch.nn as nn

from sd_kernels.ops.custom_ops import (
    fp8_gemm,
    fp8_linear,
    fp8_quantize_rows,
    layer_norm_modulated,
    layer_norm_modulated_fp8,
)
from sd_kernels.ops.fp8_geglu import geglu_rows
from sd_kernels.ops.fp8_linear import (
    E4M3,
    FP8_CAPABILITY,
    attach_quantized,
    quantize_rows,
    quantize_weight,
)
from sd_kernels.ops.fp8_linear import fp8_linear as fp8_linear_into  # eager, with out= (custom_ops' has none)
from sd_kernels.ops.weight_cache import weight_version
from sd_kernels.profiles import scoped
from sd_kernels.runtime.dispatch import interpreting

from . import families, fp8_layout, fp8_modulations, modulation_split, modulation_table
from .attention import PRECISION_PROCESSORS
from .diffusers_sources import is_verified
from .gelu import FusedGEGLU, FusedGELU
from .hooks import called_beside
from .qkv_fusion import STREAMS, FusedProjections, held
from .record import PatchRecord

log = logging.getLogger(__name__)

# The head dims whose attention the tier runs in FP8: where the FP8 kernel measured faster than our exact
# attention (H200, 2026-11-29, bench/results/2026-11-29-h200-fp8-attention-in-tier: FLUX's 128, 0.40 against
# 0.44 ms, the image 1,739 against 1,786 ms at the same PSNR); not 64 (SD3 0.55-0.61 against 0.50 ms, SDXL's
# 4,096-token self-attention 0.23-0.25 against 0.20). () keeps every attention exact. Per call the op also
# keeps calls under ops.attention.FP8_MIN_KEYS keys exact (FLUX at 768²).
FP8_ATTENTION = (128,)
# The block norms' modulation layers of a transformer as one GEMM a call (patches/fp8_modulations.py)
JOIN_MODULATIONS = True
# A cross-attention's key and value projections (``to_k``, ``to_v``, diffusers' fused ``to_kv``) read the text: a
# few hundred rows a call (SDXL with guidance: 154), where our FP8 GEMM took 15 µs and fp16's cuBLAS 5.5 at SDXL's
# shapes (bench/results/2026-11-30-h200-sdxl-fp8-gemms): they stay in the model's dtype, exact. True: FP8 too
CROSS_KV_FP8 = False
CROSS_KV = ("to_k", "to_v", "to_kv")
PRECISIONS = ("fp16", "fp8")  # "fp16": the model's own half precision (fp16 or bf16), lossless; the default
BLOCKS = ("FluxTransformerBlock", "FluxSingleTransformerBlock", "JointTransformerBlock", "BasicTransformerBlock")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Fp8Linear.offload parks nothing whose codes are on the CPU (nothing to free there); the CPU tests set this
# to run the parking path all the same (a copy within the CPU's memory)
_PARK_FROM_THE_CPU = False


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` copied to ``device`` (storage of its own, even on its own device): a parked weight's moves."""
    return tensor.to(device, copy=True)


def check_precision(precision: str | None) -> str | None:
    """None for the lossless default ("fp16" or None), "fp8" for the FP8 tier; a ValueError otherwise."""
    if precision is None or precision == "fp16":
        return None
    if precision == "fp8":
        return precision
    raise ValueError(f"precision={precision!r}: choose one of {PRECISIONS} (or None, the lossless default: fp16)")


def check_device(device: torch.device, part: str) -> None:
    """Refuse a device the FP8 kernels cannot run on: a CUDA GPU without FP8 tensor cores, the CPU
    without Triton's interpreter (``part`` names what is there in the message). Apps call it before
    building a model; ``check_models`` for each model patched."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_CAPABILITY:
            raise RuntimeError(
                f"precision='fp8' needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); the "
                f"{part} is on {torch.cuda.get_device_name(device)} (sm_{major}{minor}): patch it without "
                "precision= (the lossless default)")
    elif device.type != "cpu" or not interpreting():
        raise RuntimeError(f"precision='fp8' runs on CUDA GPUs with FP8 tensor cores (or on the CPU through "
                           f"Triton's interpreter, TRITON_INTERPRET=1); the {part} is on {device}")


def check_models(models: list[tuple[str, nn.Module]]) -> None:
    """Refuse, before any change, models the FP8 kernels cannot run: on a device ``check_device``
    refuses, or with weights in a dtype the kernels do not write."""
    for part, model in models:
        param = next(model.parameters(), None)
        if param is None:
            continue
        check_device(param.device, part)
        if param.dtype not in DTYPES:
            raise TypeError(f"precision='fp8': the {part}'s weights are {param.dtype}; the FP8 GEMMs write float16, "
                            "bfloat16 or float32")


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` as an FP8 GEMM: the original's Parameters (the same objects), the weight's
    E4M3 codes and per-channel scales beside them (buffers, not in the state_dict)."""

    profile_scoped = True

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._hold(linear)

    def _hold(self, layer: nn.Module) -> None:
        """Take ``layer``'s Parameters (the same objects) and mode, and quantize its weight."""
        self.weight = layer.weight
        self.bias = layer.bias
        self.train(layer.training)
        self._home: torch.device | None = None  # the codes' device when ``offload`` parked the weight on the CPU
        self._parked = 0  # id of the Parameter ``offload`` moved
        self._quantize()

    @staticmethod
    def _weight_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight's (e4m3 codes, fp32 scales) this layer's GEMM reads (patches/fp8_conv.py: a convolution's)."""
        return quantize_weight(weight)

    def _quantize(self) -> None:
        target = self.weight.device if self._home is None else self._buffers["w_q"].device  # parked: the codes'
        w_q, s_w = self._weight_codes(self.weight.to(target))
        self.register_buffer("w_q", w_q, persistent=False)
        self.register_buffer("s_w", s_w, persistent=False)
        self._source = self.graph_state(), w_q.data_ptr()

    def graph_state(self) -> tuple:
        """What the codes were made from: the weight's identity, storage and version counter (a
        ``weight.data = ...`` bumps no version but gives new storage). A CUDA graph replaying this
        layer bakes the codes in: it is stale once this changes."""
        return id(self.weight), *weight_version(self.weight)

    def fresh(self) -> Fp8Linear:
        """Itself, its codes made again first if its weight was replaced or changed since. A
        ``module.to(device)`` moves weight and codes together (both storages new, the codes still
        theirs: kept, as under diffusers' CPU offload), or, the weight parked by ``offload``, brings that
        weight back to the codes (kept too); ``module.to(dtype)`` casts the codes too (every floating-point
        buffer): made again."""
        if torch.compiler.is_compiling():
            return self
        state, (source, codes) = self.graph_state(), self._source
        if state == source and self.w_q.dtype == E4M3:
            return self
        same_values = state[0] == source[0] and state[2] == source[2] and self.w_q.dtype == E4M3
        if self._home is not None and self.weight.device.type != "cpu":  # a .to() took the parked weight back
            self._home = None
            if same_values and self.weight.device == self.w_q.device:
                self._requantize_in_place()  # (or a weight.data = ... did: that moves no version counter)
                return self
        if same_values and state[1] != source[1] and self.w_q.data_ptr() != codes:  # moved together
            self._source = state, self.w_q.data_ptr()
        else:
            self._quantize()
        return self

    def _requantize_in_place(self) -> None:
        """The codes made again into their own buffers, which may be views of a layout several layers share
        (``Fp8Projections``): a weight that came back from the CPU keeps that layout."""
        w_q, s_w = self._weight_codes(self.weight)
        with torch.inference_mode(self.w_q.is_inference()), torch.no_grad():
            self.w_q.copy_(w_q)
            self.s_w.copy_(s_w)
        self._source = self.graph_state(), self.w_q.data_ptr()

    def offload(self) -> int:
        """Move the original weight (kept for an exact unpatch; the GEMMs read the codes) to the CPU's memory,
        a copy of its own; returns its bytes: 0 if parked already or if the codes are on the CPU themselves
        (nothing to free: a model on the CPU, or one accelerate's offload hooks bring in for each call).
        ``restore`` brings it back."""
        self.fresh()  # the codes of the weight as it is, before it moves (no longer parked if a .to() took it back)
        if self._home is not None or (self.w_q.device.type == "cpu" and not _PARK_FROM_THE_CPU):
            return 0
        home = self.w_q.device
        with torch.inference_mode(self.weight.is_inference()), torch.no_grad():  # an inference tensor stays one
            self.weight.data = _copy_to(self.weight.data, torch.device("cpu"))
        self._home, self._parked = home, id(self.weight)
        self._source = self.graph_state(), self._source[1]  # the same values: the codes serve on
        return self.weight.numel() * self.weight.element_size()

    def restore(self) -> None:
        """Undo ``offload``: the parked weight back on the codes' device (where the module runs now: a
        ``.to()`` of the model since moved the codes), the same Parameter (cast since or not), unless it was
        replaced or moved off the CPU since. Kept parked if the copy fails (out of memory): a later
        ``restore`` tries again."""
        if self._home is None:
            return
        if id(self.weight) == self._parked and self.weight.device.type == "cpu":
            codes_fresh = self.graph_state() == self._source[0]  # else changed while parked: made again at a call
            with torch.inference_mode(self.weight.is_inference()), torch.no_grad():
                self.weight.data = _copy_to(self.weight.data, self.w_q.device)
            if codes_fresh:
                self._source = self.graph_state(), self._source[1]
        self._home = None

    @scoped
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fresh()
        return fp8_linear(x, self.w_q, self.s_w, self.bias)

    def geglu_codes(self, x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' GEGLU of this projection (``a · gelu(g)``, a and g its output's halves) as the FP8 codes
        and row scales the next GEMM reads (ops/fp8_geglu.py's ``geglu_rows``: one GEMM with the GEGLU in its
        epilogue where that is on and the kernel takes x's codes, else the GEMM writing both halves and the GEGLU
        quantizer); x's carried codes are read where it has them. Eager calls (the caller checks)."""
        self.fresh()
        return geglu_rows(x, self.w_q, self.s_w, self.bias, act)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(self(x))`` with no copy: the GEMM writes ``out`` where it lies (a token slice of a
        batch: ``fp8_gemm``'s ``out``). Eager calls, the caller having checked for hooks (``called_beside``)."""
        self.fresh()
        return fp8_linear_into(x, self.w_q, self.s_w, self.bias, out=out)

    def from_codes(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, gate: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
        """The GEMM on an input already quantized (codes q, row scales s), output in ``dtype``; with
        ``gate`` ([B, N], per sample) and ``residual`` it is ``residual + gate · y`` (``fp8_gemm``: in our
        kernel's epilogue, or one pass after torch's GEMM)."""
        self.fresh()
        return fp8_gemm(q, s, self.w_q, self.s_w, self.bias, gate=gate, residual=residual, out_dtype=dtype)

    def joined(self, prefix: torch.Tensor, x: torch.Tensor, act: str, gate: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
        """``residual + gate · self(torch.cat([prefix, gelu(x)], -1))`` (``act``: the GELU's
        approximation) with nothing but the codes written between: one kernel applies the GELU and
        quantizes both parts, the GEMM (``fp8_gemm``) gates and adds. Eager calls only (the caller checks)."""
        q, s = quantize_rows(x, act, prefix=prefix)
        return self.from_codes(q, s, x.dtype, gate, residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"


class Fp8FeedForward(nn.Module):
    """diffusers' ``FeedForward`` (act_fn, Dropout, Linear[, Dropout]) with its activation and the
    second GEMM's input quantization in one kernel. Holds the original ``net`` (whose Linears the
    patch made ``Fp8Linear``s); a training-mode call runs the original forward."""

    profile_scoped = True

    def __init__(self, ff: nn.Module, act: str, gated: bool) -> None:
        super().__init__()
        self.net = ff.net
        self.act, self.gated = act, gated
        self._original = type(ff).forward
        self._ff = [ff]  # a list: not a submodule
        self.train(ff.training)

    def _fused(self) -> bool:
        """Whether calls take the fused path: in eval mode, both GEMMs still FP8, nothing on the activation
        module or the second GEMM that calling them would run (hooks: a user's, accelerate's offload) and
        the fused path would pass by (the first GEMM is called as a module)."""
        act, second = self.net[0], self.net[2]
        return (not self.training and isinstance(act.proj, Fp8Linear) and isinstance(second, Fp8Linear)
                and not called_beside(act) and not called_beside(second))

    def reads_codes(self) -> bool:
        """Whether a call now takes the fused path, whose first GEMM reads the FP8 codes its input carries
        (``attach_quantized``): a producer may write them beside the input (patches/layer_norm.py's norm2)."""
        return self._fused()

    @scoped
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not self._fused():  # LoRA-wrapped since, training, or arguments of its own
            return self._original(self._ff[0], hidden_states, *args, **kwargs)
        return self.gated_residual(hidden_states)

    def gated_residual(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """The feed-forward of ``hidden_states``; with ``gate`` ([B, N], per sample) and ``residual``,
        ``residual + gate · ff(hidden_states)`` (either may be None), the gate and the add made by the second
        GEMM (``fp8_gemm``; a DiT block's gated residual; the blocks' fused forwards call it,
        patches/layer_norm.py)."""
        if not self._fused():
            out = self._original(self._ff[0], hidden_states)
            out = out if gate is None else gate.unsqueeze(1) * out
            return out if residual is None else residual + out
        first, second = self.net[0].proj, self.net[2]
        if self.gated and not torch.compiler.is_compiling() and not called_beside(first):
            # ops/fp8_geglu.py's one decision: the GEGLU in the GEMM's epilogue, or the GEMM and the GEGLU quantizer
            q, s = first.geglu_codes(hidden_states, self.act)
        else:  # a GELU; a compiled graph; a projection with hooks, called as itself
            q, s = fp8_quantize_rows(first(hidden_states), self.act, self.gated)
        return second.from_codes(q, s, hidden_states.dtype, gate, residual)

    def extra_repr(self) -> str:
        return f"{'GEGLU' if self.gated else 'GELU'}(approximate={self.act!r}) fused with the FP8 quantization"


def codes_travel(x: torch.Tensor) -> bool:
    """Whether FP8 codes (and what else a block hands on: ``attach_quantized``) can travel on a tensor made from
    ``x`` in this call: it has a version counter (neither x nor the call made under inference mode: an in-place change
    shows), autograd is off (a recomputing checkpoint would see a later block take what the first pass did not) and
    no compiler traces the call (it cannot trace an attribute set on a tensor and deleted)."""
    return not (torch.compiler.is_compiling() or x.is_inference() or torch.is_inference_mode_enabled()
                or torch.is_grad_enabled())


class Fp8AdaLayerNormZero(nn.Module):
    """diffusers' ``AdaLayerNormZero`` (6 chunks) or ``AdaLayerNormZeroSingle`` (3): the modulated
    LayerNorm also writes its FP8 codes, which travel on its output to the projections that read it.
    Keeps the original's ``linear``, ``silu``, ``norm`` and ``emb`` (blocks that call them directly
    still find them)."""

    profile_scoped = True
    modulations = None  # the transformer's joined modulation GEMM (patches/fp8_modulations.py), where it has one

    def __init__(self, norm: nn.Module, chunks: int) -> None:
        super().__init__()
        self.emb, self.silu, self.linear, self.norm = getattr(norm, "emb", None), norm.silu, norm.linear, norm.norm
        self.chunks = chunks
        self._norm = [norm]
        self.train(norm.training)

    def modulation(self, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``linear(silu(emb))`` in its chunks (shift, scale, then the gates and the MLP's)."""
        modulation = None if self.modulations is None else self.modulations.product(self, emb)  # one GEMM a call
        if modulation is None:
            modulation = self.linear(modulation_split.silu(self, emb))  # one SiLU and its codes a call
        return modulation.chunk(self.chunks, dim=1)

    @scoped
    def forward(self, x: torch.Tensor, *args, emb: torch.Tensor | None = None, values: bool = True, **kwargs):
        """``values`` False (the block forward's word that every reader takes the codes alone:
        patches/codes_readers.py): where the codes travel, the output is a NaN stand-in that carries them."""
        if args or kwargs or emb is None or x.dim() != 3:  # a call the blocks do not make: diffusers' forward
            return type(self._norm[0]).forward(self, x, *args, emb=emb, **kwargs)
        chunks = self.modulation(emb)
        shift, scale = chunks[0], chunks[1]
        norm = self.norm
        if torch.compiler.is_compiling():
            y = layer_norm_modulated(x, norm.weight, norm.bias, norm.eps, scale, shift)
        else:
            y, q, s = layer_norm_modulated_fp8(x, norm.weight, norm.bias, norm.eps, scale, shift,
                                               values=values or not codes_travel(x))
            attach_quantized(y, q, s)
        return (y, *chunks[2:])


class Fp8LayerNorm(nn.Module):
    """A UNet transformer block's ``nn.LayerNorm`` (``BasicTransformerBlock`` with ``norm_type="layer_norm"``: SD's,
    SDXL's norm1, norm2, norm3) that also writes its output's FP8 codes in the same pass, which travel on the
    output to the projections that read it next (q, k, v; the cross-attention's q; the feed-forward's first GEMM)
    instead of a quantization of their own. Keeps the original's ``weight``, ``bias`` (the same Parameters) and
    ``eps``; calls whose codes could not travel (training or autograd, an inference tensor, compilation) and inputs
    not [B, T, D] are the original's."""

    profile_scoped = True
    writes_codes = True  # patches/unet_blocks.py's block forward writes them with the residual add before

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self._norm = [norm]
        self.train(norm.training)

    def codes_travel(self, x: torch.Tensor) -> bool:
        """Whether the codes of this norm's output for input ``x`` can travel on it (above)."""
        return not (self.training or x.dim() != 3 or x.is_inference() or torch.is_grad_enabled()
                    or torch.compiler.is_compiling())

    @scoped
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.codes_travel(x):
            return nn.LayerNorm.forward(self, x)
        y, q, s = layer_norm_modulated_fp8(x, self.weight, self.bias, self.eps)
        return attach_quantized(y, q, s)

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, writes its FP8 codes"


def _unet_norm(block: nn.Module, name: str, child: nn.Module) -> bool:
    """Whether ``block.name`` is a UNet transformer block's plain LayerNorm that ``Fp8LayerNorm`` serves."""
    return (type(child) is nn.LayerNorm and name in ("norm1", "norm2", "norm3")
            and type(block).__name__ == "BasicTransformerBlock" and getattr(block, "norm_type", None) == "layer_norm")


class Fp8Projections:
    """One stream's q, k and v ``Fp8Linear``s as one FP8 GEMM: their codes and scales laid out in one
    buffer each (their own buffers become views of it), the biases read from the layout qkv_fusion gave
    the Parameters. Serves ``FusedProjections.project`` (FLUX) and SD3's join written in place (``operands``,
    ``into``: patches/joint_attention.py) while the module still holds these layers,
    unhooked, outside autograd and compilation, their codes still laid out (a weight changed since is
    quantized again into a buffer of its own: the call goes back to three GEMMs, and the other two layers'
    views keep the laid-out buffer, a third more codes for that stream, until unpatch); None otherwise."""

    def __init__(self, layers: list[Fp8Linear]) -> None:
        self.layers = tuple(layers)
        fp8_layout.lay_out_codes(self.layers)

    def operands(self, module: nn.Module, names: tuple[str, ...]) -> tuple | None:
        """(codes, scales, bias) of the one GEMM while it serves (above), else None."""
        if not held(module, names, self.layers):
            return None
        return fp8_layout.operands(self.layers)

    def __call__(self, module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
        operands = self.operands(module, names)
        return None if operands is None else fp8_linear(x, *operands)

    @staticmethod
    def into(operands: tuple, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The GEMM of ``operands`` (above) written into ``out`` where it lies (``fp8_gemm``'s ``out``). Eager calls."""
        return fp8_linear_into(x, *operands, out=out)


def _fuse_projections(block: nn.Module, record: PatchRecord) -> None:
    """``Fp8Projections`` for each stream of the block's attentions whose Linears qkv_fusion laid out and
    this patch made ``Fp8Linear``s (the same Parameters)."""
    for module in block.modules():
        processor = getattr(module, "processor", None)
        for attr in ("qkv", "added_qkv"):
            fused = getattr(processor, attr, None)
            if not isinstance(fused, FusedProjections):
                continue
            names = dict(STREAMS)[attr]
            layers = [module._modules.get(n) for n in names]
            if all(isinstance(m, Fp8Linear) and m.weight is linear.weight for m, linear in zip(layers, fused.linears)):
                record.set_attr(fused, "quantized", Fp8Projections(layers), "fp8.qkv")


def _feed_forward_kind(ff: nn.Module) -> tuple[str, bool] | str:
    """(activation, gated) of a FeedForward the fused forward serves, or why it does not."""
    from diffusers.models.activations import GEGLU, GELU

    net = ff.net
    if len(net) not in (3, 4) or type(net[1]) is not nn.Dropout or type(net[2]) is not nn.Linear:
        return "not act_fn, Dropout, Linear[, Dropout]"
    act = net[0]
    if type(act) not in (GELU, GEGLU, FusedGELU, FusedGEGLU) or type(act.proj) is not nn.Linear:
        return f"activation {type(act).__name__} (the fused path serves GELU and GEGLU with a plain Linear)"
    if isinstance(act, (GEGLU, FusedGEGLU)):
        return "none", True
    return act.approximate, False


def _family(path: str) -> str:
    """Which part of a block a linear layer serves, for the record's counts."""
    parts = path.split(".")
    if any(p.startswith("attn") for p in parts):
        return "attention"
    if any(p in ("ff", "ff_context") for p in parts):
        return "feed_forward"
    if any(p.startswith("norm") for p in parts):
        return "modulation"
    return "projection"  # FLUX's single-stream proj_mlp and proj_out


@dataclasses.dataclass
class Fp8Summary:
    """What the FP8 patch quantized, and the weight memory: originals (kept, on their device or, once
    ``offload_originals`` moved them, in the CPU's memory) and codes."""

    layers: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    original_bytes: int = 0
    fp8_bytes: int = 0  # codes + scales
    device: str = ""
    attention_processors: int = 0  # processors that hand precision="fp8" to the attention op
    offloaded_bytes: int = 0  # of original_bytes, those ``offload_originals`` moved to the CPU
    modulations_joined: int = 0  # block norms whose modulation is a column slice of a joined GEMM
    modulation_gemms: int = 0  # the joined GEMMs (one per group of block norms: patches/fp8_modulations.py)
    cross_kv_kept: int = 0  # cross-attention key/value projections left in the model's dtype (CROSS_KV_FP8 off)
    step_tables: int = 0  # of those, the ones whose rows of every step are made in one GEMM a call
    step_table_bytes: int = 0  # their tables' (made before the first call, kept until unpatch)
    decode_copy_bytes: int = 0  # the VAE decoder's bf16 copy, where the pipeline upcasts it (patches/bf16_decode.py)

    def add(self, family: str, layer: Fp8Linear) -> None:
        self.layers[family] += 1
        self.original_bytes += layer.weight.numel() * layer.weight.element_size()
        self.fp8_bytes += layer.w_q.numel() + 4 * layer.s_w.numel()
        self.device = str(layer.weight.device)

    def format(self) -> str:
        mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
        counts = ", ".join(f"{k} {n}" for k, n in sorted(self.layers.items()))
        where = f"stay on {self.device or 'their device'}"
        if self.offloaded_bytes == self.original_bytes > 0:
            where = f"are kept for it in the CPU's memory ({mib(self.offloaded_bytes)} moved there by " \
                    "offload_originals)"
        elif self.offloaded_bytes:
            where += f" ({mib(self.offloaded_bytes)} of them moved to the CPU's memory by offload_originals)"
        joined = ""
        if self.modulations_joined:
            joined = (f"; the modulations of {self.modulations_joined} block norms as {self.modulation_gemms} "
                      f"GEMM{'s' if self.modulation_gemms > 1 else ''} a call")
        if self.step_tables:
            joined += (f", every step's rows made in one GEMM at a call's first step and served from a table of "
                       f"{modulation_table.ROWS} rows ({mib(self.step_table_bytes)}, patches/modulation_table.py)")
        kept = (f"; {self.cross_kv_kept} cross-attention key/value projections (of the text: a few hundred rows a "
                f"call) stay in the model's dtype" if self.cross_kv_kept else "")
        if self.decode_copy_bytes:
            joined += (f"; the decode the pipeline would upcast to fp32 runs on a bf16 copy of the VAE's decoder "
                       f"({mib(self.decode_copy_bytes)}, patches/bf16_decode.py)")
        convs = self.layers.get("conv", 0)
        layers = f"{sum(self.layers.values()) - convs} linear layers" + (
            f" and {convs} 3×3 convolutions" if convs else "")
        return (f"fp8: {layers} as E4M3 GEMMs ({counts}){kept}; their weights "
                f"{mib(self.original_bytes)} {where} for an exact unpatch, the codes and scales add "
                f"{mib(self.fp8_bytes)}; {self.attention_processors} attention processors run FP8 attention where "
                f"a call takes it (docs/kernels/attention_fp8.md){joined}")


def _swap_linear(record: PatchRecord, parent: nn.Module, name: str, path: str, summary: Fp8Summary) -> None:
    layer = Fp8Linear(parent._modules[name])
    family = _family(path)
    record.set_attr(parent, name, layer, f"fp8.{family}")
    summary.add(family, layer)


def _norm_chunks(norm: nn.Module) -> int | None:
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    plain = type(getattr(norm, "norm", None)) is nn.LayerNorm and type(getattr(norm, "linear", None)) is nn.Linear
    if type(norm) is AdaLayerNormZero and norm.emb is None and plain and is_verified(AdaLayerNormZero.forward):
        return 6
    if type(norm) is AdaLayerNormZeroSingle and plain and is_verified(AdaLayerNormZeroSingle.forward):
        return 3
    return None


def _cross_kv(module: nn.Module, name: str) -> bool:
    """Whether ``module.name`` is a cross-attention's key or value projection that stays in the model's dtype
    (``CROSS_KV_FP8`` off)."""
    return not CROSS_KV_FP8 and name in CROSS_KV and getattr(module, "is_cross_attention", False) is True


def _patch_block(block: nn.Module, path: str, record: PatchRecord, summary: Fp8Summary) -> None:
    from diffusers.models.attention import FeedForward

    verified_ff = is_verified(FeedForward.forward)
    fused: list[tuple[nn.Module, str, object]] = []  # (parent, name, how to replace it): after the linears
    for sub_path, module in list(block.named_modules()):
        where = f"{path}.{sub_path}".strip(".")
        for name, child in list(module._modules.items()):
            if type(child) is FeedForward and verified_ff and not isinstance(_feed_forward_kind(child), str):
                act, gated = _feed_forward_kind(child)
                fused.append((module, name, lambda c=child, a=act, g=gated: Fp8FeedForward(c, a, g)))
            elif (chunks := _norm_chunks(child)) is not None:
                fused.append((module, name, lambda c=child, n=chunks: Fp8AdaLayerNormZero(c, n)))
            elif _unet_norm(module, name, child):
                fused.append((module, name, lambda c=child: Fp8LayerNorm(c)))
            elif type(child) is FeedForward:
                reason = "FeedForward.forward is not the verified source" if not verified_ff else \
                    _feed_forward_kind(child)
                record.skip(f"{where}.{name}", "FeedForward", f"quantize-then-GEMM per linear: {reason}")
            if type(child) is nn.Linear and _cross_kv(module, name):
                summary.cross_kv_kept += 1
            elif type(child) is nn.Linear:
                _swap_linear(record, module, name, f"{where}.{name}", summary)
            elif isinstance(child, nn.Linear):
                record.skip(f"{where}.{name}", type(child).__name__, "a subclass of nn.Linear (its forward may differ)")
            elif type(child).__name__ == "Linear" and hasattr(child, "base_layer"):
                record.skip(f"{where}.{name}", "lora.Linear", "an adapter-wrapped linear stays as it is")
    for parent, name, make in fused:  # built now: they hold the Fp8Linears swapped in above
        replacement = make()
        kind = f"fp8.{type(replacement).__name__.removeprefix('Fp8')}"
        record.set_attr(parent, name, replacement, kind)


def patch_fp8(model: nn.Module, record: PatchRecord) -> None:
    """Every known transformer block's linears as FP8 GEMMs, with the fused producers where the
    block's structure is known (module docstring); the record's ``quantized`` says what and how much."""
    summary = record.quantized if isinstance(record.quantized, Fp8Summary) else Fp8Summary()
    record.quantized = summary
    blocks = [(path, m) for path, m in model.named_modules() if type(m).__name__ in BLOCKS]
    for path, block in blocks:
        _patch_block(block, path, record, summary)
        _fuse_projections(block, record)
    if not blocks and families.is_denoiser(model):
        record.skip("", type(model).__name__, "precision='fp8': no transformer block to quantize")
    if JOIN_MODULATIONS:
        norms = [m for m in model.modules() if isinstance(m, Fp8AdaLayerNormZero)]
        joins = []
        for group in fp8_modulations.groups(norms):
            joined = fp8_modulations.Fp8Modulations(group)
            joins.append(joined)
            record.on_undo(joined.release, "fp8.modulation_biases", count=0)  # each group's, once laid out
            summary.modulation_gemms += 1
            for norm in group:
                record.set_attr(norm, "modulations", joined, "fp8.modulation_joined")
                summary.modulations_joined += 1
        if modulation_table.install(model, joins, record) is not None:
            summary.step_tables += len(joins)
            summary.step_table_bytes += sum(map(modulation_table.table_bytes, joins))
    if FP8_ATTENTION:
        _fp8_attention([block for _, block in blocks], record, summary)


def offload_originals(record: PatchRecord) -> int:
    """Move the original weights every FP8 layer of the record's models keeps for an exact unpatch to the CPU's
    memory: on the GPU the FP8 tier then holds its codes (about half the bytes) instead of adding them. One
    step joins the record's undo (``restore``), so ``unpatch`` brings them back bit for bit before it puts the
    modules back; where a copy back fails (out of memory), the step stays for the next ``unpatch``. Returns
    the bytes moved by this call."""
    parked: list[Fp8Linear] = []

    def restore() -> None:
        try:
            for layer in parked:
                layer.restore()
        except BaseException:
            record.on_undo(restore, "fp8.original_offloaded", count=0)  # the layers still parked, next time
            raise

    record.on_undo(restore, "fp8.original_offloaded", count=0)  # first: an interruption leaves nothing parked unseen
    moved = 0
    try:
        for layer in (m for model in record.models for m in model.modules() if isinstance(m, Fp8Linear)):
            if nbytes := layer.offload():
                parked.append(layer)
                moved += nbytes
    finally:
        record.counts["fp8.original_offloaded"] += len(parked)
        if isinstance(record.quantized, Fp8Summary):
            record.quantized.offloaded_bytes += moved
    return moved


def _fp8_attention(blocks: list[nn.Module], record: PatchRecord, summary: Fp8Summary) -> None:
    """``precision="fp8"`` on each of our attention processors inside the blocks whose attention has a head
    dim in ``FP8_ATTENTION`` (the attention patcher ran before; the VAE's attention, outside any block, stays
    exact); unpatch gives them back their class default ("exact") with the rest of the record."""
    seen: set[int] = set()
    for module in (m for block in blocks for m in block.modules()):
        processor = getattr(module, "processor", None)
        if (type(processor) in PRECISION_PROCESSORS and id(processor) not in seen
                and module.inner_dim // module.heads in FP8_ATTENTION):
            seen.add(id(processor))
            record.set_attr(processor, "precision", "fp8", "fp8.attention_processor")
            summary.attention_processors += 1
