"""The selection table: for SD's (and the DiTs') shapes, which kernel a profile picks and why.

A floor above the ops and the patchers (it asks their shape rules), so that ``sd_kernels.profiles``,
which the ops read, imports none of them (tests/test_layering.py).

Computed from the profile and the ops' own shape rules only (no tensors, no GPU): what ``sd-kernels
info`` prints, and what tests pin so that a profile edit that changes a decision shows up in review.
It assumes a device the kernels run on (CUDA, or the interpreter); on a CPU without the interpreter
every op runs its reference regardless (``dispatch.use_kernel``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sd_kernels.profiles import Profile

# (label, B, H, Sq, Sk, D): SD1.5's UNet at batch 2 (classifier-free guidance), the VAE's mid-block.
ATTENTION_SHAPES = [
    ("self 64²", 2, 8, 4096, 4096, 40), ("cross 64²", 2, 8, 4096, 77, 40),
    ("self 32²", 2, 8, 1024, 1024, 80), ("cross 32²", 2, 8, 1024, 77, 80),
    ("self 16²", 2, 8, 256, 256, 160), ("cross 16²", 2, 8, 256, 77, 160),
    ("vae mid", 1, 1, 4096, 4096, 512),
    # the DiTs at 1024²: PixArt-Σ's self- and cross-attention (300 T5 tokens), SD3's and FLUX's joint
    ("pixart self", 2, 16, 4096, 4096, 72), ("pixart cross", 2, 16, 4096, 300, 72),
    ("sd3 joint", 2, 24, 4429, 4429, 64), ("flux joint", 1, 24, 4608, 4608, 128),
]
GROUP_NORM_SHAPES = [(2, 320, 64, 64), (2, 1280, 8, 8), (1, 512, 64, 64), (1, 128, 512, 512)]  # 32 groups
GEGLU_SHAPES = [(8192, 320, 1280), (2048, 640, 2560), (512, 1280, 5120)]  # rows × k → n (2n projected)
GELU_SHAPES = [(8192, 1152, 4608), (8192, 1536, 6144)]  # the DiTs' tanh-GELU projections: rows × k → n
# The FP8 tier's GEMMs (rows × k → n, output dtype, epilogue): FLUX.1-dev's at 1024² (bf16), SD3-medium's (fp16)
FP8_GEMM_SHAPES = [("flux q,k,v", 4608, 3072, 9216, "bfloat16", ""), ("flux ff down + gate", 4096, 12288, 3072,
                                                                        "bfloat16", "gated"),
                   ("flux modulation", 1, 3072, 18432, "bfloat16", ""), ("sd3 q", 8192, 1536, 1536, "float16", "")]
CONV_SHAPES = [(2, 320, 64, 64, 320), (2, 640, 32, 32, 640), (2, 1280, 16, 16, 1280), (2, 1280, 8, 8, 1280),
               (1, 512, 64, 64, 512), (1, 128, 512, 512, 128)]


class Row(NamedTuple):
    op: str
    shape: str
    kernel: str
    why: str


def _attention(p: Profile, b: int, h: int, sq: int, sk: int, d: int, dtype: str) -> tuple[str, str]:
    from sd_kernels.ops.attention import FLASH_MAX_HEAD_DIM

    path, why = p.attention_choice(sq, sk, d, dtype)
    if path == "flash_wgmma" and p.disabled_reason("flash_attention"):
        path, why = p.attention_choice(sq, sk, d, dtype, wgmma=False)
    if path == "flash" and d > FLASH_MAX_HEAD_DIM:
        path, why = "partial_softmax", f"head dim {d} > the flash kernel's {FLASH_MAX_HEAD_DIM}"
    if path == "flash" and p.disabled_reason("flash_attention"):
        path, why = "partial_softmax", p.disabled_reason("flash_attention")
    if path == "partial_softmax":
        off = p.disabled_reason("partial_softmax_attention")
        if off:
            return "sdpa (stock)", off
        rows = max(1, min(sq, p.chunk_bytes() // (b * h * sk * 2)))
        chunks = -(-sq // rows)
        why += f"; scores in {chunks} chunk(s) of {rows} rows" if chunks > 1 else "; scores in one piece"
    return ("sdpa (stock)" if path == "sdpa" else path), why


def _group_norm(p: Profile, n: int, c: int, h: int, w: int, channels_last: bool) -> tuple[str, str]:
    from sd_kernels.ops.group_norm import plan

    off = p.disabled_reason("group_norm")
    if off:
        return "F.group_norm (stock)", off
    pl = plan(n, 32, c // 32, h * w, channels_last, register_file_kb=p.register_file_kb)  # at an H100's SMs
    if pl.pixels:
        return "group_norm", (f"pixel path, 3 launches; {pl.stat_chunks} / {pl.chunks} chunks a sample, "
                              f"tiles {pl.block_s}x{pl.block_c} / {pl.norm_block_s}x{pl.norm_block_c} "
                              "(statistics / normalize)")
    kind = "one tile" if pl.one_tile else f"split into {pl.chunks} programs per group" if pl.split else "looped"
    return "group_norm", f"{kind}; tile {pl.block_c}x{pl.block_s}"


def _geglu(p: Profile, rows: int, k: int, n: int) -> tuple[str, str]:

    if p.fuses_linear_geglu(k) and not p.disabled_reason("linear_geglu"):
        return "linear_geglu", f"k {k} ≤ linear_geglu_max_k {p.linear_geglu_max_k}: one fused matmul"
    off = p.disabled_reason("geglu")
    if off:
        return "chunk + F.gelu + mul (stock)", off
    return "cuBLAS linear + geglu", f"k {k} > linear_geglu_max_k {p.linear_geglu_max_k}"


def _gelu(p: Profile) -> tuple[str, str]:
    off = p.disabled_reason("linear_gelu")
    if p.gelu_epilogue and not off:
        return "cuBLASLt linear + GELU epilogue", "gelu_epilogue: one matmul, bias and tanh GELU on its accumulator"
    why = off or "the profile does not set gelu_epilogue"
    if p.disabled_reason("gelu"):
        return "cuBLAS linear + F.gelu (stock)", f"{why}; {p.disabled_reason('gelu')}"
    return "cuBLAS linear + gelu", why


def _fp8_gemm(p: Profile, rows: int, k: int, n: int, dtype: str, epilogue: str) -> tuple[str, str]:
    import torch

    from sd_kernels.ops.fp8_linear import FP8_CAPABILITY, TORCH_GEMM_CAPABILITY, torch_gemm_shape_reason

    off = p.disabled_reason("fp8_linear")
    if off:
        return "the FP8 math in torch ops (stock)", off
    span = p.match.capability if p.match is not None else None
    sm = "sm_{}{}".format
    if span is not None and span[1] < FP8_CAPABILITY:
        return "none: the tier refuses these GPUs", f"{sm(*span[0])}-{sm(*span[1])}: no FP8 tensor cores"
    older = "" if span is None or span[0] >= FP8_CAPABILITY else f"; on {sm(*FP8_CAPABILITY)} or later (the tier " \
                                                                   "refuses older GPUs)"
    ours = "our Triton FP8 GEMM"
    if not p.fp8_torch_gemm:
        return ours, "the profile does not set fp8_torch_gemm" + older
    why = torch_gemm_shape_reason(rows, k, n, getattr(torch, dtype), gated=epilogue == "gated")
    if why is not None:
        return ours, why + older
    return "torch._scaled_mm (cuBLASLt)", (f"fp8_torch_gemm, {sm(*TORCH_GEMM_CAPABILITY)} or later: row-wise "
                                           "scales, fast accumulation"
                                           + ("; gate and residual by one gated-add pass after it" if epilogue else ""))


def _conv(p: Profile, n: int, c: int, h: int, w: int, k: int, dtype: str, cl: bool) -> tuple[str, str]:
    tile = p.winograd_tile(n, c, h, w, k, dtype, "channels_last" if cl else "nchw")
    if tile is None:
        return "F.conv2d (stock)", p.disabled_reason("winograd_conv2d") or "not in the profile's winograd list"
    return f"winograd F({tile},3)", "a measured win listed in the profile"


def selection_table(profile: Profile, dtype: str = "float16") -> list[Row]:
    rows = [Row("attention", f"{label} {b}x{h}x{sq}x{sk}x{d}", *_attention(profile, b, h, sq, sk, d, dtype))
            for label, b, h, sq, sk, d in ATTENTION_SHAPES]
    rows += [Row("group_norm", f"{n}x{c}x{h}x{w} {'nhwc' if cl else 'nchw'}", *_group_norm(profile, n, c, h, w, cl))
             for n, c, h, w in GROUP_NORM_SHAPES for cl in (False, True)]
    rows += [Row("geglu", f"{r}x{k}->{n}", *_geglu(profile, r, k, n)) for r, k, n in GEGLU_SHAPES]
    rows += [Row("gelu tanh", f"{r}x{k}->{n}", *_gelu(profile)) for r, k, n in GELU_SHAPES]
    rows += [Row("fp8 gemm", f"{label} {r}x{k}->{n} {dtype}", *_fp8_gemm(profile, r, k, n, dtype, e))
             for label, r, k, n, dtype, e in FP8_GEMM_SHAPES]
    rows += [Row("conv3x3", f"{n}x{c}x{h}x{w}->{k} {'nhwc' if cl else 'nchw'}",
                 *_conv(profile, n, c, h, w, k, dtype, cl)) for n, c, h, w, k in CONV_SHAPES for cl in (False, True)]
    return rows


def format_table(rows: list[Row]) -> str:
    widths = [max(len(str(r[i])) for r in [Row._fields, *rows]) for i in range(4)]
    lines = ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip() for r in [Row._fields, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def launchers() -> dict[str, Any]:
    """Every kernel launcher of ``sd_kernels.ops`` by its cache-file name (importing each op module)."""
    import importlib
    import pkgutil

    import sd_kernels.ops
    from sd_kernels.runtime.launch import Launcher

    found: dict[str, Any] = {}
    for info in pkgutil.iter_modules(sd_kernels.ops.__path__):
        module = importlib.import_module(f"sd_kernels.ops.{info.name}")
        found.update({v.name: v for v in vars(module).values() if isinstance(v, Launcher)})
    return found


def tuning_sources(profile: Profile, device: Any = None) -> list[tuple[str, str]]:
    """(kernel, where its launch configurations come from on ``device`` under ``profile``) for every
    kernel with configs to choose from: the table that serves it, or the rule's source (what
    ``sd-kernels info`` prints)."""
    from sd_kernels.runtime import autotune_cache

    dirs = autotune_cache.shipped_device_dirs(device, profile)
    rows = []
    for name, launcher in sorted(launchers().items()):
        if launcher.tunable:
            table = autotune_cache.CacheFile(None, launcher, dirs)
            rows.append((name.removeprefix("sd_kernels.ops."), table.describe()))
    return rows
