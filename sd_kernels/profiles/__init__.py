"""Device profiles: what runs where, as data.

A profile is one JSON file beside this module (``hopper.json``, ``s23-ultra.json``, ...), loaded
into the frozen ``Profile`` dataclass and validated: an unknown key, a wrong type or a value out of
bounds is a ``ProfileError`` naming the file, the key and what is allowed. JSON rather than Python
literals because a profile is a table of device numbers that users copy and edit for their own
device (``SD_KERNELS_PROFILE=/path/to/mine.json`` loads one), and because docs/profiles.md cites a
source for each number: the data stays apart from the code that reads it.

Which profile is active: inside a patched model, the profile of its patch (``scoped`` methods of
the modules the patch installs, and its CUDA graphs, enter ``using_profile``: two models patched
with different profiles each run under their own); elsewhere (bare ``sd_kernels.ops`` calls) the
process default: the last ``set_profile``, else ``$SD_KERNELS_PROFILE``, else detection from the CUDA
device's name, capability and SM count, else ``cpu``. The mobile profiles match no device: they
are emulations, chosen by name.

What a profile decides (every decision is a pure function of the profile and a shape, so the
selection table of ``sd-kernels info`` needs no GPU):
- ``disabled_reason(op)``: an op (or fusion) switched off;
- ``attention_path(sq, sk, head_dim, dtype)``: flash_wgmma / flash / partial_softmax / sdpa (the
  ``attention`` policy; "auto" = flash where the head dim and the on-chip memory allow, else the
  partial softmax; the Hopper wgmma kernel or stock SDPA at the head dims measured for them);
- ``winograd_tile(n, c, h, w, k, dtype)``: the Winograd F(m, 3) tile for one conv, or None;
- ``gelu_epilogue``, ``fp8_torch_gemm``: whether cuBLASLt serves a tanh-GELU projection with its GELU
  epilogue, and the FP8 tier's bf16 and fp16 GEMMs through torch's ``_scaled_mm`` (ops/gelu.py,
  ops/fp8_linear.py);
- ``chunk_bytes()``: how large one chunked intermediate (attention scores, a feed-forward slice) may
  be, from the intermediate budget;
- ``memory_budget_bytes()``: the whole process's budget (weights + intermediates), enforced by
  ``sd_kernels.runtime.memory``;
- ``fp16_tflops`` / ``bandwidth_gbps``: the phone profiles' device figures for the latency model
  (``sd_kernels.analysis.latency``: a roofline estimate, not a measurement).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

ATTENTION_POLICIES = ("auto", "flash", "partial_softmax", "sdpa")
# the pipeline parts ``channels_last`` may name (patches.PARTS)
LAYOUT_PARTS = ("unet", "vae", "controlnet", "transformer")
WINOGRAD_LAYOUTS = ("nchw", "channels_last")
WINOGRAD_TILES = (2, 4, 6, 8)  # ops.winograd.TILES (a test keeps them equal; no Triton import here)
# Every op name that ``dispatch.use_kernel`` is asked about (a test greps the sources for them).
KNOWN_OPS = ("flash_attention", "partial_softmax_attention", "softmax_matmul", "group_norm", "gelu", "geglu",
             "linear_geglu", "linear_gelu", "winograd_conv2d", "conv2d", "layer_norm", "residual",
             "upsample_conv2d", "pack8", "fp8_linear", "fp8_quant", "attention_fp8", "qk_norm_rope",
             "attention_merge", "gated_add", "fp8_geglu", "fp8_conv")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# With an intermediate budget, one chunked intermediate (a slice of attention scores or of the
# feed-forward's 2n-wide projection) may take this share of it: the rest holds the activations
# that live across the chunk loop (the block's input, q/k/v, the output being filled).
CHUNK_SHARE = 4
DEFAULT_CHUNK_BYTES = 256 * 2**20  # no intermediate budget: ops.attention's historical default
# Fewer keys than this never take the wgmma kernel: at PixArt-Σ's 300-key cross-attention it measured
# 0.065 ms against cuDNN's 0.060 (H100, 2026-11-25); at 4,096 keys 0.403 against 0.448.
WGMMA_MIN_KEYS = 1024
_DIR = pathlib.Path(__file__).parent


class ProfileError(ValueError):
    """A profile file or object that does not validate."""


@dataclasses.dataclass(frozen=True)
class WinogradRule:
    """Use F(tile, 3) for exactly this conv: x [n, c, h, w] → k channels, in ``dtype``, with x in
    ``layout`` ("nchw" or "channels_last": a win measured in one layout says nothing of the other)."""

    n: int
    c: int
    h: int
    w: int
    k: int
    dtype: str
    tile: int
    layout: str = "nchw"

    def matches(self, n: int, c: int, h: int, w: int, k: int, dtype: str, layout: str = "nchw") -> bool:
        return (self.n, self.c, self.h, self.w, self.k, self.dtype, self.layout) == (n, c, h, w, k, dtype, layout)


@dataclasses.dataclass(frozen=True)
class Match:
    """Which CUDA devices a profile is for: capability within [lo, hi], and (if given) a name matching
    one of ``names`` (regular expressions, searched) and at least ``min_sms`` SMs."""

    capability: tuple[tuple[int, int], tuple[int, int]]
    names: tuple[str, ...] = ()
    min_sms: int = 0

    def fits(self, name: str, capability: tuple[int, int], sms: int) -> bool:
        lo, hi = self.capability
        return (lo <= capability <= hi and sms >= self.min_sms
                and (not self.names or any(re.search(p, name) for p in self.names)))


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    match: Match | None = None  # None: never detected, only chosen by name (CPU, mobile emulations)
    # Memory the whole process may hold on the device (weights + intermediates), MB; None: the device's.
    memory_budget_mb: int | None = None
    # Peak intermediates one component (a UNet step, a VAE decode) should stay under, MB; it sizes
    # the chunks (attention scores, feed-forward slices). None: no chunking beyond DEFAULT_CHUNK_BYTES.
    intermediate_budget_mb: int | None = None
    # On-chip memory per block/workgroup and register file per block, KB; they bound kernel tiles.
    # register_file_kb None: unknown, so accumulators and score tiles count against shared memory.
    shared_memory_kb: int | None = None
    register_file_kb: int | None = None
    attention: str = "auto"
    flash_block: tuple[int, int] = (128, 64)  # (BLOCK_M query rows, BLOCK_N keys) of the fit rule
    flash_min_keys: int = 0  # "auto": below this many keys the partial softmax's scores are small
    # "auto": head dims where the Hopper wgmma kernel (ops/attention_wgmma.py) was measured faster than
    # stock SDPA, for calls of at least WGMMA_MIN_KEYS keys; a call that kernel cannot take (a mask,
    # no sm_90, not Triton 3.6) takes the path this profile picks without it
    wgmma_attention_head_dims: tuple[int, ...] = ()
    # "auto": head dims where stock SDPA was measured faster than our kernels on this device (run there)
    stock_attention_head_dims: tuple[int, ...] = ()
    # "auto": the same for fp32 calls only (the VAEs' mid-block attention, head dim 512, in SDXL's fp32 decode)
    stock_attention_fp32_head_dims: tuple[int, ...] = ()
    # "auto": at least this many keys, not a multiple of 64, go to stock SDPA (None: never). The flash
    # kernel then masks every key block (docs/kernels/attention.md); SD3's joint 4,429 tokens measured slower.
    stock_attention_ragged_keys: int | None = None
    # GEGLU's projection runs as the fused linear_geglu kernel when its input features K are at most
    # this (0: never; cuBLAS linear + our geglu). The fused kernel saves the 2n-wide intermediate but
    # its matmul loses to cuBLAS as K grows (docs/kernels/gelu.md); SD's K: 320, 640, 1280.
    linear_geglu_max_k: int = 0
    # A tanh-GELU projection (diffusers' GELU module with approximate="tanh": the DiTs' feed-forward)
    # runs as one cuBLASLt matmul with its bias + GELU epilogue instead of cuBLAS's linear and our
    # gelu kernel (sd_kernels.ops.gelu.linear_gelu; CUDA only; docs/kernels/gelu.md).
    gelu_epilogue: bool = False
    # The FP8 tier's bf16 and fp16 GEMMs of at least 64 rows whose epilogue is a bias (or a bias, gate and
    # residual) run on torch's row-wise torch._scaled_mm (cuBLASLt, fast accumulation) instead of our Triton
    # kernels (sd_kernels.ops.fp8_linear.TORCH_GEMM_DTYPES; CUDA only; docs/fp8.md, "The GEMM").
    fp8_torch_gemm: bool = False
    # Upsample2D (nearest 2× + 3×3 conv) runs as the polyphase 2×2 conv (ops.upsample_conv2d) when its
    # input has at least this many pixels (H·W), else as diffusers runs it. On the H100 the SD1.5 UNet's
    # 2×1280×8² upsampler lost (0.84x: the GEMM is small, the interleave a pass of its own) and
    # 2×1280×16² won (1.21x) (docs/kernels/upsample.md).
    polyphase_min_pixels: int = 256
    # With an intermediate budget, the streamed VAE decode may keep an activation in 8 bits (int8 codes,
    # a float32 scale per pixel and 32 channels: ops.pack8) where that is at least 1 ms faster by its
    # plan's model: where the activation in the decode's dtype does not fit the budget beside a band.
    # Lossy (each element off by up to half a step of its group's largest value): the image is then
    # close to the untiled one (PSNR in docs/profiles.md), not equal to it up to rounding.
    stream_pack8: bool = False
    winograd: tuple[WinogradRule, ...] = ()
    disabled_ops: frozenset[str] = frozenset()
    autotune_cache: str | None = None  # a directory for autotune results ("{name}" is substituted)
    # Pipeline parts ("unet", "vae") whose conv weights the patch makes channels_last (NHWC), so that
    # cuDNN and the GroupNorm kernel run on NHWC activations; () leaves the memory format alone.
    channels_last: tuple[str, ...] = ()
    # The device's peak fp16 throughput (TFLOP/s) and memory bandwidth (GB/s), for the latency model
    # of the phone profiles (sd_kernels/analysis/latency.py; sources in docs/profiles.md); None: not modelled.
    fp16_tflops: float | None = None
    bandwidth_gbps: float | None = None

    def __post_init__(self) -> None:
        _validate(self)
        # Per-profile memo of attention_path (not a field: equality and hashing ignore it). An
        # lru_cache keyed on the profile would hash every field, the Winograd table too, on each
        # attention call: measured as a visible part of the eager host time.
        object.__setattr__(self, "_paths", {})

    # -- decisions -------------------------------------------------------------------------------

    def fuses_linear_geglu(self, k: int) -> bool:
        """Whether a GEGLU projection with ``k`` input features runs as the fused linear_geglu."""
        return k <= self.linear_geglu_max_k

    def disabled_reason(self, op: str) -> str | None:
        if op in self.disabled_ops:
            return f"profile {self.name!r} disables {op}"
        return None

    def flash_fit_reason(self, head_dim: int, dtype: str = "float16") -> str | None:
        """Why the flash kernel's working set does not fit this profile's on-chip memory, or None.

        Per block: Q, K and V tiles in shared memory (input dtype, one stage), and the fp32
        accumulator [BLOCK_M, D] plus the fp32 score tile [BLOCK_M, BLOCK_N] in registers, or also in
        shared memory when the register file is unknown. D is padded to a multiple of 16 (tl.dot).
        """
        if self.shared_memory_kb is None:
            return None
        bm, bn = self.flash_block
        d = -(-head_dim // 16) * 16
        tiles = DTYPE_BYTES.get(dtype, 4) * d * (bm + 2 * bn)
        accum = 4 * bm * (d + bn)
        smem, regs = self.shared_memory_kb * 1024, (self.register_file_kb or 0) * 1024
        if self.register_file_kb is None:
            if tiles + accum > smem:
                return (f"tiles {tiles} B + accumulators {accum} B > {smem} B of on-chip memory at head dim "
                        f"{head_dim} ({bm}x{bn} tile)")
            return None
        if tiles > smem:
            return f"Q/K/V tiles {tiles} B > {smem} B of shared memory at head dim {head_dim} ({bm}x{bn} tile)"
        if accum > regs:
            return f"accumulators {accum} B > {regs} B of registers at head dim {head_dim} ({bm}x{bn} tile)"
        return None

    def attention_choice(self, sq: int, sk: int, head_dim: int, dtype: str = "float16",
                         wgmma: bool = True) -> tuple[str, str]:
        """(path, why) the policy picks before the kernels' own limits: "flash_wgmma", "flash",
        "partial_softmax" or "sdpa". ``dispatch.use_kernel`` may still refuse a kernel (device, dtype,
        shape); ``wgmma=False``: the choice for a call the wgmma kernel cannot take."""
        if self.attention != "auto":
            return self.attention, f"profile {self.name!r} sets attention={self.attention}"
        if (wgmma and head_dim in self.wgmma_attention_head_dims and sk >= WGMMA_MIN_KEYS
                and dtype in ("float16", "bfloat16")):
            return "flash_wgmma", (f"head dim {head_dim}, {sk} keys: the Hopper wgmma kernel measured faster "
                                   "here than the path without it (wgmma_attention_head_dims; needs sm_90 and "
                                   "Triton 3.6, else that path)")
        if head_dim in self.stock_attention_head_dims:
            return "sdpa", f"head dim {head_dim}: stock SDPA measured faster here (stock_attention_head_dims)"
        if dtype == "float32" and head_dim in self.stock_attention_fp32_head_dims:
            return "sdpa", (f"fp32 at head dim {head_dim}: stock SDPA measured faster here "
                            "(stock_attention_fp32_head_dims)")
        ragged = self.stock_attention_ragged_keys
        if ragged is not None and sk >= ragged and sk % 64:
            return "sdpa", (f"{sk} keys, not a multiple of 64: every key block masked; stock SDPA measured faster "
                            f"here (stock_attention_ragged_keys {ragged})")
        misfit = self.flash_fit_reason(head_dim, dtype)
        if misfit is not None:
            return "partial_softmax", misfit
        if sk < self.flash_min_keys:
            return "partial_softmax", f"{sk} keys < flash_min_keys {self.flash_min_keys}: scores are small"
        return "flash", f"head dim {head_dim} fits on chip"

    def attention_path(self, sq: int, sk: int, head_dim: int, dtype: str = "float16") -> str:
        key = (sq, sk, head_dim, dtype)  # it runs once per attention call: memoized
        path = self._paths.get(key)
        if path is None:
            if len(self._paths) >= 4096:
                self._paths.clear()
            path = self._paths[key] = self.attention_choice(sq, sk, head_dim, dtype)[0]
        return path

    def winograd_tile(self, n: int, c: int, h: int, w: int, k: int, dtype: Any, layout: str = "nchw") -> int | None:
        """The Winograd tile for a 3×3 conv x [n, c, h, w] → k channels in ``dtype`` (a torch dtype or
        its name) with x in ``layout``, or None (stock conv). Only the profile's listed shapes: each is
        a measured win."""
        if self.disabled_reason("winograd_conv2d"):
            return None
        name = str(dtype).removeprefix("torch.")
        return next((r.tile for r in self.winograd if r.matches(n, c, h, w, k, name, layout)), None)

    def routes_winograd(self, c: int, k: int, layout: str = "nchw") -> bool:
        """Whether any call of a c → k channel 3×3 conv in ``layout`` may be routed (the patch swaps
        only those)."""
        return not self.disabled_reason("winograd_conv2d") and any(
            (r.c, r.k, r.layout) == (c, k, layout) for r in self.winograd)

    def chunk_bytes(self) -> int:
        """The most bytes one chunked intermediate may take (see CHUNK_SHARE)."""
        if self.intermediate_budget_mb is None:
            return DEFAULT_CHUNK_BYTES
        return self.intermediate_budget_mb * 2**20 // CHUNK_SHARE

    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget_mb is None else self.memory_budget_mb * 2**20

    def autotune_cache_dir(self) -> pathlib.Path | None:
        if self.autotune_cache is None:
            return None
        return pathlib.Path(os.path.expanduser(self.autotune_cache.format(name=self.name)))

    def describe(self) -> dict[str, Any]:
        """The profile as plain data (what ``sd-kernels info`` prints and a JSON file holds)."""
        return _to_json(self)


# ---------------------------------------------------------------------------------------------
# Validation and loading


def _fail(where: str, key: str, value: Any, allowed: str) -> None:
    raise ProfileError(f"profile {where}: {key} = {value!r}; expected {allowed}")


def _check_int(where: str, key: str, value: Any, lo: int, hi: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _fail(where, key, value, f"an integer in [{lo}, {hi}]" + (" or null" if optional else ""))


def _validate(p: Profile) -> None:
    where = repr(p.name)
    if not isinstance(p.name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", p.name):
        _fail(where, "name", p.name, "lower-case letters, digits and dashes")
    if not isinstance(p.description, str) or not p.description or len(p.description) > MAX_DESCRIPTION:
        _fail(where, "description", p.description[:80] + "…" if isinstance(p.description, str) else p.description,
              f"a non-empty string of at most {MAX_DESCRIPTION} characters")
    if p.autotune_cache is not None:
        if not isinstance(p.autotune_cache, str) or not p.autotune_cache:
            _fail(where, "autotune_cache", p.autotune_cache, 'a directory path (may hold "{name}") or null')
        try:
            p.autotune_cache.format(name=p.name)
        except (KeyError, IndexError, ValueError) as exc:
            _fail(where, "autotune_cache", p.autotune_cache, f'a path whose only placeholder is {{name}} ({exc!r})')
    _check_int(where, "memory_budget_mb", p.memory_budget_mb, 64, 2**22)
    _check_int(where, "intermediate_budget_mb", p.intermediate_budget_mb, 4, 2**20)
    _check_int(where, "shared_memory_kb", p.shared_memory_kb, 4, 1024)
    _check_int(where, "register_file_kb", p.register_file_kb, 4, 1024)
    _check_int(where, "stock_attention_ragged_keys", p.stock_attention_ragged_keys, 1, 2**30)
    for key in ("fp16_tflops", "bandwidth_gbps"):
        value = getattr(p, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < 1e6):
            _fail(where, key, value, "a positive number or null")
    _check_int(where, "flash_min_keys", p.flash_min_keys, 0, 2**20, optional=False)
    _check_int(where, "linear_geglu_max_k", p.linear_geglu_max_k, 0, 2**20, optional=False)
    _check_int(where, "polyphase_min_pixels", p.polyphase_min_pixels, 0, 2**40, optional=False)
    for key in ("gelu_epilogue", "fp8_torch_gemm", "stream_pack8"):
        if not isinstance(getattr(p, key), bool):
            _fail(where, key, getattr(p, key), "true or false")
    for key in ("stock_attention_head_dims", "stock_attention_fp32_head_dims", "wgmma_attention_head_dims"):
        for d in getattr(p, key):
            _check_int(where, key, d, 1, 2**12, optional=False)
    if any(d > 128 or d % 8 for d in p.wgmma_attention_head_dims):
        _fail(where, "wgmma_attention_head_dims", list(p.wgmma_attention_head_dims),
              "head dims the wgmma kernel takes: multiples of 8 up to 128")
    if p.attention not in ATTENTION_POLICIES:
        _fail(where, "attention", p.attention, f"one of {ATTENTION_POLICIES}")
    bm, bn = p.flash_block if len(p.flash_block) == 2 else (0, 0)
    if not all(isinstance(b, int) and 16 <= b <= 256 and b & (b - 1) == 0 for b in (bm, bn)):
        _fail(where, "flash_block", p.flash_block, "[BLOCK_M, BLOCK_N], powers of two in [16, 256]")
    unknown = set(p.disabled_ops) - set(KNOWN_OPS)
    if unknown:
        _fail(where, "disabled_ops", sorted(unknown), f"names from {KNOWN_OPS}")
    for r in p.winograd:
        if (r.tile not in WINOGRAD_TILES or r.dtype not in DTYPE_BYTES or min(r.n, r.c, r.h, r.w, r.k) < 1
                or r.layout not in WINOGRAD_LAYOUTS):
            _fail(where, "winograd", dataclasses.asdict(r), f"positive n, c, h, w, k; dtype in {tuple(DTYPE_BYTES)}; "
                  f"tile in {WINOGRAD_TILES}; layout in {WINOGRAD_LAYOUTS}")
    if not set(p.channels_last) <= set(LAYOUT_PARTS) or len(set(p.channels_last)) != len(p.channels_last):
        _fail(where, "channels_last", list(p.channels_last), f"distinct names from {LAYOUT_PARTS}")
    if p.match is not None:
        lo, hi = p.match.capability
        if not lo <= hi:
            _fail(where, "match.capability", [lo, hi], "[[major, minor], [major, minor]], low ≤ high")
    if p.memory_budget_mb and p.intermediate_budget_mb and p.intermediate_budget_mb > p.memory_budget_mb:
        _fail(where, "intermediate_budget_mb", p.intermediate_budget_mb, f"≤ memory_budget_mb {p.memory_budget_mb}")


_FIELDS = {f.name for f in dataclasses.fields(Profile)}
MAX_DESCRIPTION = 2000  # characters
MAX_FILE_BYTES = 1 << 20  # a profile file (the catalog's largest is a few kB)
_MATCH_KEYS = {"capability", "names", "min_sms"}
_WINOGRAD_KEYS = {f.name for f in dataclasses.fields(WinogradRule)}


def _keys(where: str, what: str, data: Any, allowed: set[str], required: set[str]) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"profile {where}: {what} must be an object, got {type(data).__name__}")
    unknown, missing = set(data) - allowed, required - set(data)
    if unknown:
        raise ProfileError(f"profile {where}: unknown key(s) {sorted(unknown)} in {what}; known: {sorted(allowed)}")
    if missing:
        raise ProfileError(f"profile {where}: {what} lacks {sorted(missing)}")


def _tuple_pair(where: str, key: str, value: Any) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        _fail(where, key, value, "a pair of integers")
    return tuple(value)


def from_dict(data: dict[str, Any], where: str = "<dict>") -> Profile:
    """A validated Profile from its JSON form (the keys are the dataclass's fields)."""
    _keys(where, "the profile", data, _FIELDS, {"name", "description"})
    kw = dict(data)
    if kw.get("match") is not None:
        m = kw["match"]
        _keys(where, "match", m, _MATCH_KEYS, {"capability"})
        cap = m["capability"]
        if not isinstance(cap, list) or len(cap) != 2:
            _fail(where, "match.capability", cap, "[[major, minor], [major, minor]]")
        names = m.get("names", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            _fail(where, "match.names", names, "a list of regular expressions")
        kw["match"] = Match((_tuple_pair(where, "match.capability", cap[0]),
                             _tuple_pair(where, "match.capability", cap[1])), tuple(names), m.get("min_sms", 0))
    if "flash_block" in kw:
        kw["flash_block"] = _tuple_pair(where, "flash_block", kw["flash_block"])
    rules = []
    if not isinstance(kw.get("winograd", []), list):
        _fail(where, "winograd", kw["winograd"], "a list of rules")
    for i, r in enumerate(kw.get("winograd", [])):
        _keys(where, "a winograd rule", r, _WINOGRAD_KEYS, _WINOGRAD_KEYS - {"layout"})
        for key, value in r.items():  # the types first: the bounds checks compare them
            kind = str if key in ("dtype", "layout") else int
            if isinstance(value, bool) or not isinstance(value, kind):
                _fail(where, f"winograd[{i}].{key}", value, "a string" if kind is str else "an integer")
        rules.append(WinogradRule(**r))
    kw["winograd"] = tuple(rules)
    ops = kw.get("disabled_ops", [])
    if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
        _fail(where, "disabled_ops", ops, "a list of op names")
    kw["disabled_ops"] = frozenset(ops)
    for key, expected in (("channels_last", f"a list of part names from {LAYOUT_PARTS}"),
                          ("stock_attention_head_dims", "a list of head dims"),
                          ("stock_attention_fp32_head_dims", "a list of head dims"),
                          ("wgmma_attention_head_dims", "a list of head dims")):  # JSON lists, tuples here
        value = kw.get(key, [])
        if not isinstance(value, list):
            _fail(where, key, value, expected)
        kw[key] = tuple(value)
    try:
        return Profile(**kw)
    except TypeError as exc:  # a value of the wrong type that the bounds checks tripped over
        raise ProfileError(f"profile {where}: {exc}") from None


def _to_json(p: Profile) -> dict[str, Any]:
    out = dataclasses.asdict(p)
    out["disabled_ops"] = sorted(p.disabled_ops)
    out["flash_block"] = list(p.flash_block)
    out["channels_last"] = list(p.channels_last)
    out["stock_attention_head_dims"] = list(p.stock_attention_head_dims)
    out["stock_attention_fp32_head_dims"] = list(p.stock_attention_fp32_head_dims)
    out["wgmma_attention_head_dims"] = list(p.wgmma_attention_head_dims)
    if p.match is not None:
        out["match"] = {"capability": [list(c) for c in p.match.capability], "names": list(p.match.names),
                        "min_sms": p.match.min_sms}
    return out


def load_file(path: str | os.PathLike) -> Profile:
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ProfileError(f"profile file {path}: {size} bytes; a profile is at most {MAX_FILE_BYTES}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile file {path}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    return from_dict(data, str(path))


def _load_catalog() -> dict[str, Profile]:
    catalog = {}
    for path in sorted(_DIR.glob("*.json")):
        p = load_file(path)
        if p.name != path.stem:
            raise ProfileError(f"profile file {path}: name {p.name!r} differs from the file name")
        catalog[p.name] = p
    return catalog


_CATALOG = _load_catalog()
# Detection tries these in order; the first whose ``match`` fits wins (most specific first).
DETECTION_ORDER = ("hopper", "ampere", "consumer", "cuda")
_active: Profile | None = None


def list_profiles() -> list[str]:
    return list(_CATALOG)


def detect_profile(device: Any | None) -> Profile:
    """The catalog profile for a CUDA device: anything with ``name``, ``major``, ``minor`` and
    ``multi_processor_count`` (torch.cuda.get_device_properties, or a fake); None: no GPU → cpu."""
    if device is None:
        return _CATALOG["cpu"]
    cap, sms = (device.major, device.minor), device.multi_processor_count
    for name in DETECTION_ORDER:
        match = _CATALOG[name].match
        if match is not None and match.fits(device.name, cap, sms):
            return _CATALOG[name]
    return _CATALOG["cpu"]


def _resolve(profile: str | Profile) -> Profile:
    if isinstance(profile, Profile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a name, a Profile or None, got {type(profile).__name__}")
    if profile in _CATALOG:
        return _CATALOG[profile]
    if profile.endswith(".json"):
        if not os.path.isfile(profile):
            raise ValueError(f"profile file {profile}: not found" if not os.path.exists(profile)
                             else f"profile file {profile}: not a file")
        return load_file(profile)
    raise ValueError(f"unknown profile {profile!r}; known profiles: {', '.join(_CATALOG)} (or a path to a .json)")


def get_profile(profile: str | Profile | None = None) -> Profile:
    """``profile`` (a name, a JSON path or a Profile), else $SD_KERNELS_PROFILE, else the profile
    detected for the current CUDA device (cpu without one)."""
    if profile is None:
        profile = os.environ.get("SD_KERNELS_PROFILE") or None
    if profile is not None:
        return _resolve(profile)
    import torch

    return detect_profile(torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None)


_SCOPE: contextvars.ContextVar[Profile | None] = contextvars.ContextVar("sd_kernels_profile", default=None)


def active_profile() -> Profile:
    """The profile dispatch consults: the innermost ``using_profile``'s (a patched model's own), else
    the process default: the last ``set_profile``, else ``get_profile()``. The one reader of the
    scope, called only at call time (docs/profiles.md, "Which profile is active", lists its callers)."""
    scoped = _SCOPE.get()
    if scoped is not None:
        return scoped
    global _active
    if _active is None:
        _active = get_profile()
    return _active


@contextlib.contextmanager
def using_profile(profile: Profile | None) -> Iterator[Profile | None]:
    """Run the block under ``profile`` (None: leave the current one)."""
    token = _SCOPE.set(profile) if profile is not None else None
    try:
        yield profile
    finally:
        if token is not None:
            _SCOPE.reset(token)


def scoped(method: Callable) -> Callable:
    """Decorate a method of an object a patch installs: it runs under the profile of that patch
    (``obj._sd_profile``, which ``PatchRecord.set_attr`` sets on objects whose class has
    ``profile_scoped = True``). While torch.compile traces, the method runs as it is: the compiled
    code's custom ops decide at run time, under the scope of whatever calls the compiled code (the
    patch's CUDA graphs enter it; a model compiled by the user runs under the process default)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        profile = self.__dict__.get("_sd_profile")
        if profile is None or torch_compiling():
            return method(self, *args, **kwargs)
        token = _SCOPE.set(profile)
        try:
            return method(self, *args, **kwargs)
        finally:
            _SCOPE.reset(token)

    return run


def torch_compiling() -> bool:
    import torch  # (a module lookup once torch is loaded; profiles load without importing it)

    return torch.compiler.is_compiling()


def set_profile(profile: str | Profile | None) -> Profile:
    """Make ``profile`` (or, for None, the one get_profile() picks) the one dispatch consults."""
    global _active
    _active = get_profile(profile)
    return _active
