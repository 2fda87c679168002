"""A cuDNN convolution's bias added by ``ops.bias_residual`` instead of by torch.

torch runs ``F.conv2d(x, w, b)`` on CUDA as cuDNN's convolution without the bias, then adds the bias in an
elementwise kernel of its own over the output and a broadcast [1, C, 1, 1] view of it: an operand of stride 0
keeps that kernel off torch's vectorized path. At SD's shapes it moves 1.2–1.9 TB/s where ``ops.bias_residual``
(the same sum, in fp32, rounded once to the output's dtype: the same values) moves 3.2–5.0 TB/s in place: for
SDXL's VAE, 20 such adds took 3.9 ms of a 21.8 ms bf16 decode, and six took 0.17 ms of the UNet's step
(H200, 2026-12-01: bench/results/2026-12-01-h200-conv-bias-and-norm-codes/).

Which convolutions: every module of exact type ``nn.Conv2d`` with a bias that a model's other patches leave on
cuDNN (``WinogradConv2d`` runs its own forward). Its class stays ``nn.Conv2d`` — every check of an exact type
(the upsampler's polyphase path, the streamed decode, the FP8 convolutions) sees what it saw — and the instance
gets a ``_conv_forward``, the method ``nn.Conv2d.forward`` calls and the patched ResNet forward calls without a bias
where it folds that bias elsewhere (patches/group_norm.py). A call it does not serve (autograd, compilation, autocast,
the reference backend, a device or dtype the kernels refuse) is ``nn.Conv2d._conv_forward`` with the bias. Installed by
the ``winograd`` op family (the convolutions' family); exactly reversible with the record.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from sd_kernels.ops.residual import bias_residual
from sd_kernels.profiles import active_profile
from sd_kernels.runtime.dispatch import device_reason, reference_backend, tensor_reason

from .record import PatchRecord

KIND = "conv_bias_add"


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a convolution of ``x`` with ``weight`` adds ``bias`` with ``ops.bias_residual``: not under autocast
    (torch rounds the bias to the convolution's lower-precision output first, then adds: other values), nor for an
    empty input."""
    return (bias is not None and not reference_backend() and not torch.compiler.is_compiling()
            and x.numel() > 0 and device_reason(x.device) is None  # a kernel device (autocast knows no other)
            and not torch.is_autocast_enabled(x.device.type) and tensor_reason(x, weight, bias) is None
            and active_profile().disabled_reason("residual") is None)


def _conv_forward(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.Conv2d._conv_forward`` with the bias added by ``ops.bias_residual`` in place where ``serves``."""
    if not serves(x, weight, bias):
        return nn.Conv2d._conv_forward(conv, x, weight, bias)
    y = nn.Conv2d._conv_forward(conv, x, weight, None)
    return bias_residual(y, bias, out=y)


def patch_conv_bias(model: nn.Module, record: PatchRecord) -> None:
    """Give every ``nn.Conv2d`` (exact type) of ``model`` with a bias the ``_conv_forward`` above (a hook on the
    module runs around its forward as before; a LoRA layer wrapping one calls its forward)."""
    for conv in model.modules():
        if type(conv) is nn.Conv2d and conv.bias is not None and "_conv_forward" not in vars(conv):
            # a partial, not a bound method: a pickled model then loads (a bound method pickles by name)
            record.set_attr(conv, "_conv_forward", functools.partial(_conv_forward, conv), KIND)
