"""The ops, one family per file. Each public function has the contract of the function of the
same name in ``sd_kernels.reference``, asks ``sd_kernels.runtime.dispatch.use_kernel`` once per call, and
runs its Triton kernel or the reference accordingly."""

from .attention import flash_attention
from .attention_fp8 import attention_fp8
from .attention_parts import attention_lse, merge_attention
from .conv import conv2d
from .fp8_conv import conv3x3_fp8
from .fp8_linear import fp8_gemm, fp8_linear, quantize_rows
from .gelu import geglu, gelu, linear_geglu, linear_gelu
from .group_norm import group_norm
from .group_stats import group_norm_given, group_partials, group_stats, mean_rstd, merge_group_stats
from .layer_norm import (
    gated_residual_layer_norm,
    gated_residual_layer_norm_fp8,
    layer_norm_modulated,
    layer_norm_modulated_fp8,
)
from .pack8 import pack8, unpack8
from .residual import bias_residual, gated_add
from .rope import qk_norm_rope, qk_norm_rope_kv
from .softmax_matmul import partial_softmax_attention, softmax_matmul
from .upsample import upsample_conv2d
from .winograd import winograd_conv2d, winograd_weight

__all__ = [
    "attention_fp8",
    "attention_lse",
    "bias_residual",
    "conv2d",
    "conv3x3_fp8",
    "flash_attention",
    "fp8_gemm",
    "fp8_linear",
    "gated_add",
    "gated_residual_layer_norm",
    "gated_residual_layer_norm_fp8",
    "geglu",
    "gelu",
    "group_norm",
    "group_norm_given",
    "group_partials",
    "group_stats",
    "layer_norm_modulated",
    "layer_norm_modulated_fp8",
    "linear_geglu",
    "linear_gelu",
    "mean_rstd",
    "merge_attention",
    "merge_group_stats",
    "pack8",
    "qk_norm_rope",
    "qk_norm_rope_kv",
    "quantize_rows",
    "partial_softmax_attention",
    "softmax_matmul",
    "unpack8",
    "upsample_conv2d",
    "winograd_conv2d",
    "winograd_weight",
]
