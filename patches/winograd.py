"""3×3 convolutions of a UNet / VAE onto Winograd F(m×m, 3×3), where the active profile routes them.

Winograd is a measured bet, not a blanket win (docs/kernels/winograd.md, docs/results.md): on the
H100 it beats cuDNN only where cuDNN's implicit GEMM has little parallelism (many channels, small
maps), and loses on the VAE's large maps. So the decision is data, per call: the profile's
``winograd_tile(n, c, h, w, k, dtype)`` names a tile for this conv shape, or None (stock conv).

Each qualifying ``nn.Conv2d`` (exact type; 3×3, stride 1, padding 1, dilation 1, groups 1, zero
padding: ``unsupported_conv``) that the profile may route becomes a ``WinogradConv2d``: the same
module class contract, holding the original's parameters (same ``nn.Parameter`` objects, same
state_dict). Its transformed weights U = G g Gᵀ are computed on the first routed call and cached on
the module (not in its state_dict): that is the memory Winograd costs, (m+2)²/9 times the conv's
weights (1.78x for F(2,3)), paid only for convs that are routed. The cache follows the weight: a new
tensor or an in-place update (its version counter) recomputes it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from sd_kernels.ops import custom_ops
from sd_kernels.ops.layout import is_channels_last
from sd_kernels.ops.weight_cache import weight_version
from sd_kernels.ops.winograd import WeightCache, WinogradWeight, unsupported_conv, winograd_conv2d
from sd_kernels.profiles import active_profile, scoped

from .channels_last import makes_channels_last
from .families import family_of
from .record import PatchRecord

# Swap convs only in a UNet whose calls are replayed from CUDA graphs (``patch(..., cuda_graph=True)``)
# unless this is True. Measured on the H100 (bench/results/2026-11-22-h100-ops/winograd_deep.csv): one
# eager F(2,3) call at 2×1280×16² (NCHW) takes 0.22 ms against cuDNN's 0.13 ms, though its device time is
# 0.047 against 0.118 ms: three launches of host time where cuDNN needs one, and an eager UNet step is
# bound by the host. Replayed from a graph the host cost is gone. (The graph wrapper's warm-up call
# runs the same routing as the capture, so Triton autotuning and the weight transform happen there.)
ROUTE_EAGER = False

# nn.Conv2d's own attributes that its forward reads (torch's Conv2d.__constants__ and the padding
# it precomputes): a WinogradConv2d carries the original's, so its stock path is Conv2d's forward.
_CONV_ATTRS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "transposed",
               "output_padding", "groups", "padding_mode", "_reversed_padding_repeated_twice")


class WinogradConv2d(nn.Conv2d):
    """nn.Conv2d that runs as Winograd F(m, 3) on the calls the active profile routes.

    A subclass (``isinstance(m, nn.Conv2d)`` holds) built with ``nn.Module.__init__`` only: no new
    parameters are created.
    """

    profile_scoped = True

    def __init__(self, original: nn.Conv2d) -> None:
        nn.Module.__init__(self)
        for name in _CONV_ATTRS:
            setattr(self, name, getattr(original, name))
        self.register_parameter("weight", original.weight)
        self.register_parameter("bias", original.bias)
        self.train(original.training)
        self._cache = WeightCache(original.weight)

    def tile_for(self, x: torch.Tensor) -> int | None:
        """The profile's tile for this call, or None for the stock conv (inputs whose dtype is not the
        weight's run stock). Under torch.compile the decision is made once, at trace time, from the
        static shape: the compiled graph holds the custom op or the stock conv."""
        if x.dim() != 4 or x.dtype != self.weight.dtype:
            return None
        n, c, h, w = x.shape
        layout = "channels_last" if is_channels_last(x) else "nchw"
        return _route(n, c, h, w, self.out_channels, x.dtype, layout)

    def transformed(self, tile: int) -> WinogradWeight:
        if self._cache.weight is not self.weight:  # the parameter was replaced
            self._cache = WeightCache(self.weight)
        return self._cache.get(tile)

    @scoped
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tile = self.tile_for(x)
        if tile is None:
            return self._conv_forward(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # one opaque op; it finds self._cache by the weight
            return custom_ops.winograd_conv2d(x, self.weight, self.bias, tile)
        return winograd_conv2d(x, self.transformed(tile), self.bias)

    def transformed_bytes(self) -> int:
        """Bytes held by the cached transformed weights (the memory this module adds)."""
        return self._cache.nbytes()

    def graph_state(self) -> tuple:
        """What a CUDA graph that replays this conv's Winograd launches bakes in: the transformed
        weights of the weight as it was. A captured graph is stale once this changes (the weight
        replaced or updated in place), and its re-capture transforms the weight again."""
        return id(self.weight), *weight_version(self.weight)


@torch.compiler.assume_constant_result
def _route(n: int, c: int, h: int, w: int, k: int, dtype: torch.dtype, layout: str) -> int | None:
    """The active profile's tile (a constant for torch.compile: shapes are static there)."""
    return active_profile().winograd_tile(n, c, h, w, k, dtype, layout)


def qualifies(conv: nn.Module) -> bool:
    """An nn.Conv2d (exact type) that Winograd F(m, 3) can compute."""
    return type(conv) is nn.Conv2d and unsupported_conv(
        conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode) is None


def patch_winograd(model: nn.Module, record: PatchRecord) -> None:
    """Swap the qualifying 3×3 convs of ``model`` for ``WinogradConv2d`` where the patch's profile
    may route their channel counts (``Profile.routes_winograd(c, k)``): in a UNet replayed from CUDA
    graphs (``ROUTE_EAGER`` explains why only there); none under a profile that routes no conv, so
    that such profiles pay no per-call routing cost."""
    profile = record.profile_spec
    layout = "channels_last" if makes_channels_last(model, record) else "nchw"
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()
             if qualifies(child) and profile.routes_winograd(child.in_channels, child.out_channels, layout)]
    if not slots and layout == "channels_last" and profile.winograd:
        record.skip("", "3x3 convs", f"profile {profile.name!r} routes Winograd for NCHW inputs only and this model "
                    "runs channels_last (its channels_last list): cuDNN's NHWC convs stand (docs/kernels/winograd.md)")
        return
    fam = family_of(model)
    if slots and not (ROUTE_EAGER or (record.cuda_graph and fam is not None and fam.winograd)):
        record.skip("", f"{len(slots)} routable 3x3 convs",
                    "winograd runs only in a UNet patched with cuda_graph=True (host cost)")
        return
    for parent, name, child in slots:  # collected first: no swapping while walking the tree
        record.set_attr(parent, name, WinogradConv2d(child), "winograd_conv")
