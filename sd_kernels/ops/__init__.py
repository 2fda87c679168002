"""The ops, one family per file. Each public function has the contract of the function of the
same name in ``sd_kernels.reference``, asks ``sd_kernels.dispatch.use_kernel`` once per call, and
runs its Triton kernel or the reference accordingly."""

from .attention import flash_attention
from .conv import conv2d
from .gelu import geglu, gelu, linear_geglu
from .group_norm import group_norm
from .softmax_matmul import partial_softmax_attention, softmax_matmul
from .winograd import winograd_conv2d, winograd_weight

__all__ = [
    "conv2d",
    "flash_attention",
    "geglu",
    "gelu",
    "group_norm",
    "linear_geglu",
    "partial_softmax_attention",
    "softmax_matmul",
    "winograd_conv2d",
    "winograd_weight",
]
