"""Every GroupNorm of a UNet2DConditionModel / AutoencoderKL onto ``sd_kernels.ops.group_norm``,
fused with the SiLU that follows it where diffusers applies one.

Three kinds of change, counted in the record under these names:

* ``resnet_fused_forward`` (+ 2 × ``group_norm_silu``): a ResnetBlock2D whose ``nonlinearity`` is
  SiLU gets its norms swapped for fused GroupNorm+SiLU modules and its instance ``forward`` rebound
  to ``_resnet_forward``, a copy of diffusers 0.42.1's forward that skips the SiLU a fused norm has
  already applied, and (``_folds_into_norm2``) runs a plain conv1 without its bias, handing bias +
  temb to norm2 as its shift: the sum is normalized without being
  written (docs/kernels/group_norm.md); and (``_fused_tail``) runs conv2 and the shortcut conv without
  their biases and adds the biases and the shortcut and divides by ``output_scale_factor`` in one pass
  (``ops.bias_residual``). Neither under SD_KERNELS_BACKEND=reference, which keeps stock's arithmetic. The block's
  ``nonlinearity`` itself is untouched: forward also applies it to ``temb``.
  With ``time_embedding_norm="scale_shift"`` the SiLU comes after the scale and shift,
  so norm2 is swapped without it (``group_norm``). The copy is only used while diffusers' forward
  is the one it copies (a hash of its source); under another diffusers version the norms are
  swapped without the SiLU instead (``group_norm``), which is always exact.
* ``group_norm_silu`` + ``silu_folded``: ``conv_norm_out`` of UNet2DConditionModel and of the VAE's
  Encoder and Decoder is always followed by ``conv_act``, and ``conv_act`` is called nowhere else
  (checked in diffusers 0.42.1: their forwards; UNetMotionModel.from_unet2d only copies its empty
  state_dict), so the norm takes the SiLU and ``conv_act`` becomes nn.Identity.
* ``group_norm``: every other module of exact type nn.GroupNorm (Transformer2DModel.norm,
  Attention.group_norm in the VAE mid-block, ...). A plain nn.GroupNorm computes F.group_norm
  whoever calls it, so the swap is exact wherever it sits.

Anything else is left alone: subclasses of nn.GroupNorm, SpatialNorm and other conditioned norms
(a plain nn.GroupNorm inside one is swapped like any other), blocks of other classes, activations
other than SiLU. Replacement modules hold the original parameters (the same nn.Parameter objects),
so state_dict keys and values do not change.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from sd_kernels.ops.custom_ops import group_norm
from sd_kernels.ops.residual import bias_residual
from sd_kernels.profiles import scoped
from sd_kernels.runtime.dispatch import reference_backend

from . import call_gate
from .diffusers_sources import VERIFIED_WITH, is_verified
from .hooks import global_hooks
from .record import PatchRecord


class FusedGroupNorm(nn.GroupNorm):
    """nn.GroupNorm (+ SiLU) through sd_kernels, on the original module's parameters.

    A subclass, so that ``isinstance(m, nn.GroupNorm)`` keeps holding for code that inspects
    models; ``nn.Module.__init__`` only: no new parameters are created.
    """

    profile_scoped = True

    def __init__(self, original: nn.GroupNorm, activation: str | None = None) -> None:
        nn.Module.__init__(self)
        self.num_groups = original.num_groups
        self.num_channels = original.num_channels
        self.eps = original.eps
        self.affine = original.affine
        self.register_parameter("weight", original.weight)
        self.register_parameter("bias", original.bias)
        self.activation = activation

    @scoped
    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """``shift`` ([N, C], ours alone: nn.GroupNorm takes x only): normalize x + shift[:, :, None, …]
        without writing the sum (``_resnet_forward`` passes conv1's bias + the time embedding)."""
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.activation, shift)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


def resnet_forward_is_known() -> bool:
    """True if diffusers' ResnetBlock2D.forward is the one ``_resnet_forward`` mirrors."""
    from diffusers.models.resnet import ResnetBlock2D

    return is_verified(ResnetBlock2D.forward)


# diffusers warns, and ignores the argument, when a block gets ``scale``: so do we, in our words.
SCALE_DEPRECATION = ("ResnetBlock2D/Attention: `scale` is deprecated by diffusers and ignored here; pass it "
                     "to the pipeline through `cross_attention_kwargs` instead.")


def _fused_silu(norm: nn.Module) -> bool:
    return isinstance(norm, FusedGroupNorm) and norm.activation == "silu"


def _plain_conv(conv: nn.Module | None) -> bool:
    """A plain, hook-free nn.Conv2d (a LoRA layer, a WinogradConv2d or an offloading hook runs its own forward),
    or a module that is one as far as ``_conv_forward(x, weight, bias)`` goes (``plain_conv``: the FP8 tier's
    ``Fp8Conv2d``, patches/fp8_conv.py)."""
    return ((type(conv) is nn.Conv2d or getattr(type(conv), "plain_conv", False))
            and not (conv._forward_hooks or conv._forward_pre_hooks or global_hooks()))


def _folds_into_norm2(block: nn.Module, temb: torch.Tensor | None) -> bool:
    """Whether conv1's bias and the time embedding can reach norm2 as its ``shift`` instead of being
    added to conv1's output (an elementwise pass over it): diffusers' "default" time-embedding norm,
    a projected temb, our norm2, and conv1 a plain conv with a bias. Not the VAE's blocks (no time
    embedding): their norm2 with a shift is a GroupNorm launch the shipped tuning tables do not hold yet
    (tests/test_tuning_coverage.py), to be tuned on both Hopper GPUs before the bias folds there too."""
    return (block.time_embedding_norm == "default" and temb is not None and block.time_emb_proj is not None
            and isinstance(block.norm2, FusedGroupNorm) and _plain_conv(block.conv1) and block.conv1.bias is not None
            and not reference_backend())


def _fused_tail(block: nn.Module) -> bool:
    """Whether conv2's bias, the shortcut (and its 1×1 conv's bias), the residual add and
    ``/ output_scale_factor`` can be one pass (``ops.bias_residual``) instead of three to five: plain convs,
    conv2 with a bias, eval (dropout before conv2 is then nothing), not the reference backend, not traced by
    torch.compile (inductor fuses the stock lines itself)."""
    return (not block.training and _plain_conv(block.conv2) and block.conv2.bias is not None
            and (block.conv_shortcut is None or _plain_conv(block.conv_shortcut))
            and not reference_backend() and not torch.compiler.is_compiling())


def _resnet_forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """diffusers 0.42.1 ``ResnetBlock2D.forward``, line for line, except that the SiLU after a norm
    is skipped when that norm already applied it (``_fused_silu``), that where
    ``_folds_into_norm2`` holds, conv1 runs without its bias and norm2 normalizes
    conv1(x) + (bias + temb) from a per-(sample, channel) shift in fp32: the same sum, never written
    (diffusers rounds conv1's output and the sum to the activations' dtype; this rounds the conv
    output without the bias, and the rest in fp32), and that where ``_fused_tail`` holds, conv2 and the
    shortcut conv run without their biases and (conv2(h) + bias + shortcut + its bias) / output_scale_factor
    is one pass in fp32, rounded once (``ops.bias_residual``, as the streamed decode finishes a block)."""
    from diffusers.utils import deprecate

    if len(args) > 0 or kwargs.get("scale", None) is not None:
        deprecate("scale", "1.0.0", SCALE_DEPRECATION)

    hidden_states = input_tensor

    hidden_states = self.norm1(hidden_states)
    if not _fused_silu(self.norm1):
        hidden_states = self.nonlinearity(hidden_states)

    if self.upsample is not None:
        # upsample_nearest_nhwc fails with large batch sizes (huggingface/diffusers#984)
        if hidden_states.shape[0] >= 64:
            input_tensor = input_tensor.contiguous()
            hidden_states = hidden_states.contiguous()
        input_tensor = self.upsample(input_tensor)
        hidden_states = self.upsample(hidden_states)
    elif self.downsample is not None:
        input_tensor = self.downsample(input_tensor)
        hidden_states = self.downsample(hidden_states)

    fold = _folds_into_norm2(self, temb)
    if fold:
        hidden_states = self.conv1._conv_forward(hidden_states, self.conv1.weight, None)
    else:
        hidden_states = self.conv1(hidden_states)

    if self.time_emb_proj is not None:
        if not self.skip_time_act:
            temb = self.nonlinearity(temb)
        temb = self.time_emb_proj(temb)[:, :, None, None]

    if fold:
        shift = temb[:, :, 0, 0].float() + self.conv1.bias.float()
        hidden_states = self.norm2(hidden_states, shift.expand(hidden_states.shape[:2]))
    elif self.time_embedding_norm == "default":
        if temb is not None:
            hidden_states = hidden_states + temb
        hidden_states = self.norm2(hidden_states)
    elif self.time_embedding_norm == "scale_shift":
        if temb is None:
            raise ValueError(
                f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}"
            )
        time_scale, time_shift = torch.chunk(temb, 2, dim=1)
        hidden_states = self.norm2(hidden_states)
        hidden_states = hidden_states * (1 + time_scale) + time_shift
    else:
        hidden_states = self.norm2(hidden_states)

    if not _fused_silu(self.norm2):
        hidden_states = self.nonlinearity(hidden_states)

    hidden_states = self.dropout(hidden_states)
    if _fused_tail(self):  # conv2 and the shortcut without their biases, then the tail in one pass
        hidden_states = self.conv2._conv_forward(hidden_states, self.conv2.weight, None)
        shortcut_bias = None
        if self.conv_shortcut is not None:
            input_tensor = self.conv_shortcut._conv_forward(input_tensor, self.conv_shortcut.weight, None)
            shortcut_bias = self.conv_shortcut.bias
        return bias_residual(hidden_states, self.conv2.bias, input_tensor, shortcut_bias, self.output_scale_factor,
                             out=hidden_states)
    hidden_states = self.conv2(hidden_states)

    if self.conv_shortcut is not None:
        # Only use contiguous() during training to avoid DDP gradient stride mismatch warning.
        if self.training:
            input_tensor = input_tensor.contiguous()
        input_tensor = self.conv_shortcut(input_tensor)

    output_tensor = (input_tensor + hidden_states) / self.output_scale_factor

    return output_tensor


def _is_plain(module: nn.Module | None) -> bool:
    return type(module) is nn.GroupNorm


def _swap(record: PatchRecord, parent: nn.Module, name: str, activation: str | None) -> None:
    kind = "group_norm_silu" if activation == "silu" else "group_norm"
    record.set_attr(parent, name, FusedGroupNorm(parent._modules[name], activation), kind)


def _patch_resnet(path: str, block: nn.Module, record: PatchRecord) -> None:
    if not resnet_forward_is_known():
        record.skip(path, "ResnetBlock2D.forward", f"not the diffusers {VERIFIED_WITH} forward the fused SiLU mirrors: "
                    "norms swapped, SiLU not fused")
        return  # the generic pass below swaps whatever plain GroupNorms it has
    if not (type(block.nonlinearity) is nn.SiLU and _is_plain(block.norm1) and _is_plain(block.norm2)):
        record.skip(path, "ResnetBlock2D", f"nonlinearity {type(block.nonlinearity).__name__} or norms "
                    "that are not plain GroupNorms: SiLU not fused")
        return
    _swap(record, block, "norm1", "silu")
    _swap(record, block, "norm2", None if block.time_embedding_norm == "scale_shift" else "silu")
    record.set_attr(block, "forward", types.MethodType(_resnet_forward, block), "resnet_fused_forward")


def _patch_norm_out(owner: nn.Module, record: PatchRecord) -> None:
    norm, act = owner._modules.get("conv_norm_out"), owner._modules.get("conv_act")
    if _is_plain(norm) and type(act) is nn.SiLU:
        _swap(record, owner, "conv_norm_out", "silu")
        record.set_attr(owner, "conv_act", nn.Identity(), "silu_folded")


def patch_group_norm(model: nn.Module, record: PatchRecord) -> None:
    """Swap every GroupNorm of ``model`` (see the module docstring for what is fused and skipped)."""
    from diffusers.models.autoencoders.vae import Decoder, Encoder
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

    modules = list(model.named_modules())  # collected first: no swapping while walking the tree
    for path, module in modules:
        if type(module) is ResnetBlock2D:
            _patch_resnet(path, module, record)
        elif call_gate.class_of(module) in (UNet2DConditionModel, Encoder, Decoder):  # the model: gated while changed
            _patch_norm_out(module, record)
        elif isinstance(module, nn.GroupNorm) and type(module) not in (nn.GroupNorm, FusedGroupNorm):
            record.skip(path, type(module).__name__, "subclass of nn.GroupNorm (its forward may differ)")
    slots = [(parent, name) for parent in model.modules() for name, child in parent._modules.items()
             if _is_plain(child)]
    for parent, name in slots:
        _swap(record, parent, name, None)
