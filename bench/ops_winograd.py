"""Winograd F(m×m, 3×3) vs cuDNN at SD1.5's UNet and VAE conv shapes (fp16), and the paper's tile table.

Per shape and layout (NCHW, channels_last) one case: "stock" is cuDNN channels_last (the fastest stock
path), "cudnn_nchw" cuDNN on the NCHW input (NCHW cases), "ours_f2/f4/f6" our three kernels with
M in fp32, "ours_f4_m16" the same with M in fp16 (half of M's traffic), "ours_f4_bmm" the GEMM on
cuBLAS (torch.bmm, M in fp16), "ours_f4_fused" the GEMM with the output transform in its epilogue
(experimental: no M buffer at all). Weights are transformed once, outside the timing, as a patch caches
them. flops = the direct conv's 2·N·K·C·9·H·W for every impl (effective TFLOP/s); bytes = x, weight
and y once. Errors are vs float64 on the bottom-right 32×32 outputs (the image edge and, for m = 6,
the overhanging last tiles), computed from a 33×33 input window.

``paper_table()`` (an EXTRA) runs ``winograd_table`` at the VAE's 1×512×64×64→512 in fp16: the
paper's columns computed from the tensors our op allocates, next to our and cuDNN's errors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from bench.common import Case, rotating
from sd_kernels import reference
from sd_kernels.ops import winograd as wg
from sd_kernels.testing import channels_last, rel_err

EXTRAS = ["paper_table"]

UNET = [(2, 320, 64, 64, 320), (2, 640, 32, 32, 640), (2, 1280, 16, 16, 1280)]
VAE = [(1, 512, 64, 64, 512), (1, 512, 128, 128, 512), (1, 256, 256, 256, 256), (1, 128, 512, 512, 128)]
TILES = (2, 4, 6)
WINDOW = 32  # side of the output window the errors are measured on


def _inputs(N, C, H, W, K, dtype=torch.float16):
    x = torch.randn(N, C, H, W, device="cuda", dtype=dtype)
    w = (torch.randn(K, C, 3, 3, device="cuda") / (3 * C**0.5)).to(dtype)
    b = torch.randn(K, device="cuda", dtype=dtype)
    return x, w, b


def _window_error(outputs: dict[str, torch.Tensor], x, w, b) -> dict[str, float]:
    """Rel. error of each output's bottom-right WINDOW² block vs a float64 conv of that corner."""
    s = min(WINDOW, x.shape[-2], x.shape[-1])
    corner = x[..., -(s + 1):, -(s + 1):]
    ref64 = reference.conv2d_3x3(*reference.upcast(corner, w, b))[..., -s:, -s:]
    return {name: rel_err(y[..., -s:, -s:], ref64) for name, y in outputs.items()}


def _case(shape, layout: str, tiles=TILES, variants_f4: bool = True) -> Case:
    N, C, H, W, K = shape
    x, w, b = _inputs(*shape)
    u = {tile: wg.winograd_weight(w, tile) for tile in tiles}
    nchw = layout == "nchw"

    def in_layout(t):
        return t if nchw else channels_last(t)

    def make():  # (input in the case's layout, the same values channels_last for stock)
        xs = torch.randn_like(x)
        return in_layout(xs), channels_last(xs)

    nxt = rotating(make, 2 * x.numel() * x.element_size())
    variants = {f"ours_f{tile}": (tile, {}) for tile in tiles}
    if variants_f4:
        variants["ours_f4_m16"] = (4, {"m_dtype": torch.float16})
        variants["ours_f4_bmm"] = (4, {"gemm": "bmm"})
        variants["ours_f4_fused"] = (4, {"gemm": "fused"})

    def ours(xl, tile, variant):
        if variant:
            return wg._winograd(xl, u[tile].u, b, tile, **variant)
        return wg.winograd_conv2d(xl, u[tile], b)

    impls = {"stock": lambda: F.conv2d(nxt()[1], w, b, padding=1)}
    if nchw:
        impls["cudnn_nchw"] = lambda: F.conv2d(nxt()[0], w, b, padding=1)
    for name, (tile, variant) in variants.items():
        impls[name] = lambda tile=tile, variant=variant: ours(nxt()[0], tile, variant)

    # Errors on one fixed input, outside the timing.
    outputs = {"stock": F.conv2d(channels_last(x), w, b, padding=1)}
    if nchw:
        outputs["cudnn_nchw"] = F.conv2d(x, w, b, padding=1)
    outputs.update({name: ours(in_layout(x), tile, variant) for name, (tile, variant) in variants.items()})
    errors = _window_error(outputs, x, w, b)
    del outputs

    return Case(
        op="conv3x3_winograd",
        shape=f"{N}x{C}x{H}x{W}->{K}",
        dtype=x.dtype,
        variant=layout,
        impls=impls,
        bytes=(x.numel() + w.numel() + N * K * H * W) * x.element_size(),
        flops=2 * N * K * C * 9 * H * W,
        errors=errors,
    )


def cases(quick: bool) -> Iterator[Case]:
    shapes = [UNET[0], VAE[1], VAE[3]] if quick else UNET + VAE
    for shape in shapes:
        for layout in ("channels_last", "nchw"):
            yield _case(shape, layout)


def paper_table(shape=(1, 512, 64, 64, 512)) -> list[dict]:
    """The paper's Winograd tile table from our kernels (tiles 2, 4, 6, 8; fp16; cuDNN's error beside)."""
    x, w, b = _inputs(*shape)
    rows = wg.winograd_table(channels_last(x), w, b, tiles=wg.TILES)
    return [{"shape": "{}x{}x{}x{}->{}".format(*shape), **r} for r in rows]
