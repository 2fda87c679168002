"""The FP8 tier's UNet ResNet convolutions: each ``ResnetBlock2D``'s ``conv1`` and ``conv2`` (3×3, stride 1, padding 1)
as an FP8 implicit GEMM (ops/fp8_conv.py), where the 3×3 convolutions are most of what stays fp16 in a UNet step.

``Fp8Conv2d`` holds the convolution's Parameters (the same objects) and its weight's e4m3 codes with one scale an
output channel beside them, as ``Fp8Linear`` does for a linear layer (whose bookkeeping it inherits: codes made
again after a weight changes, ``offload_originals``, the CUDA graphs' watch through ``graph_state``). A call
quantizes its input with one scale a sample and runs ``ops.fp8_conv.conv3x3_fp8``; it keeps ``nn.Conv2d``'s
``_conv_forward(x, weight, bias)``, which the patched ResNet forward calls without a bias where it folds the bias
into the next op (patches/group_norm.py: ``plain_conv``). A call it does not serve runs ``F.conv2d`` on the
original weight: autograd, training, compilation (torch.compile traces stock's convolution), an input
``ops.fp8_conv.conv_reason`` refuses, another weight passed in.

Opt-in (``FP8_CONV``, off: it did not pay in SDXL's step, below). While on, ``patch(pipe, precision="fp8")``
installs it after the linear layers (patches/__init__.py), on the denoiser's ResNet blocks only (the VAE stays
as it is); a convolution of another shape, with hooks or of a subclass (a LoRA-wrapped one) is left alone and
listed. Exactly reversible with the record.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sd_kernels.ops.fp8_conv import DTYPES, conv3x3_fp8, conv_reason, quantize_conv_weight
from sd_kernels.profiles import scoped
from sd_kernels.runtime.dispatch import declined

from .fp8 import Fp8Linear, Fp8Summary
from .hooks import called_beside
from .record import PatchRecord

# Opt-in (True): the ResNet blocks' 3×3 convolutions in FP8. Off, as measured: in SDXL's FP8 step the convolutions
# took 3.34 ms against cuDNN's 4.02, but quantizing their inputs (two passes over each) took the 0.70 ms back, the
# step 25.28 against 25.26 ms, and the image fell from 51.3 to 43.7 dB PSNR (H200, 2026-11-30:
# docs/kernels/fp8_conv.md). What would make it pay: the GroupNorm + SiLU before each writing the codes.
FP8_CONV = False
_CONVS = ("conv1", "conv2")


class Fp8Conv2d(Fp8Linear):
    """A 3×3 ``nn.Conv2d`` (stride 1, padding 1, one group) as an FP8 implicit GEMM: the original's Parameters,
    the weight's codes [C_out, 9·C_in] and scales [C_out] beside them (buffers, not in the state_dict)."""

    plain_conv = True  # patches/group_norm.py may call ``_conv_forward`` without the bias, folding it elsewhere

    def __init__(self, conv: nn.Conv2d) -> None:
        nn.Module.__init__(self)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups, self.padding_mode = conv.dilation, conv.groups, conv.padding_mode
        self._hold(conv)

    @staticmethod
    def _weight_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_conv_weight(weight)

    def _serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the call runs in FP8; an input the kernel refuses is also counted in ``dispatch.fallbacks()``."""
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if weight is not self.weight or self.training or grad or torch.compiler.is_compiling():
            return False
        reason = conv_reason(x, self.w_q)
        if reason is not None:
            declined("fp8_conv", reason)
        return reason is None

    @scoped
    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``nn.Conv2d._conv_forward``: the FP8 convolution with ``bias`` (None: none) where it serves the call."""
        if self._serves(x, weight):
            self.fresh()
            return conv3x3_fp8(x, self.w_q, self.s_w, bias)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight, self.bias)

    def offload(self) -> int:
        """Nothing: the calls it does not serve (autograd, compilation, ``_serves``) read the original weight where
        the input is, so ``offload_originals`` leaves it on the device."""
        return 0

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size=(3, 3), padding=(1, 1), e4m3"


def unserved(conv: nn.Module) -> str | None:
    """Why ``conv`` (a ResNet block's conv1 or conv2) stays as it is, or None: a plain, unhooked 3×3 ``nn.Conv2d``
    of stride 1, padding 1, one group, zero padding, an fp16, bf16 or fp32 weight, input channels a multiple of 32."""
    if type(conv) is not nn.Conv2d:
        return "not an nn.Conv2d (a subclass or an adapter-wrapped one keeps its forward)"
    if conv.weight.dtype not in DTYPES:
        return f"a {conv.weight.dtype} weight (the kernel takes fp16, bf16 and fp32 inputs)"
    if called_beside(conv):
        return "hooks on the convolution"
    if (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode) != (
            (3, 3), (1, 1), (1, 1), (1, 1), 1, "zeros"):
        return "not a 3×3 convolution of stride 1, padding 1, one group"
    if conv.in_channels % 32:
        return f"{conv.in_channels} input channels, not a multiple of 32"
    return None


def patch_convs(model: nn.Module, record: PatchRecord) -> None:
    """Every ``ResnetBlock2D`` (exact type) of the denoiser ``model``: conv1 and conv2 as ``Fp8Conv2d`` where
    ``unserved`` finds nothing against it; counted in the record's FP8 summary (family "conv")."""
    if not FP8_CONV:
        return
    from diffusers.models.resnet import ResnetBlock2D

    summary = record.quantized if isinstance(record.quantized, Fp8Summary) else Fp8Summary()
    record.quantized = summary
    for path, block in model.named_modules():
        if type(block) is not ResnetBlock2D:
            continue
        for name in _CONVS:
            conv = block._modules.get(name)
            why = unserved(conv)
            if why is not None:
                record.skip(f"{path}.{name}", type(conv).__name__, f"precision='fp8': {why}")
                continue
            layer = Fp8Conv2d(conv)
            record.set_attr(block, name, layer, "fp8.conv")
            summary.add("conv", layer)
