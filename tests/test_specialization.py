"""What a new image size compiles: launches whose only difference is an integer argument's divisibility by
16 (Triton specializes integer arguments on it) share one compiled kernel where that divisibility buys
nothing, so a warm process compiles nothing new for them at a new size.

Read from the specialization data Triton's JIT serializes for its ``jit_cache_hook`` (the compile key,
constants and attributes of the launch), recorded in a process without the interpreter under a stand-in
CUDA driver (tests/cuda_standin.py), from the package's own host code: GroupNorm's one-tile kernel at
two image sizes whose groups pad to the same tile, channels_last (its vectors run along the channels);
the partial softmax's row statistics and fused matmul at two row counts; the pixel path's merge at two
sizes and batches; the one-tile kernel at three sizes with and without a shift, the pixel path at two channel
counts that pad alike. Where the pixels are the
vector axis (NCHW), the one-tile kernel is compiled for Hopper and its stores must stay 16-byte vectors."""

import json
import re
import textwrap

import cuda_standin
import pytest

SCRIPT = textwrap.dedent("""
    import importlib, json, re
    import torch
    import cuda_standin

    cuda_standin.install()
    gn = importlib.import_module("sd_kernels.ops.group_norm")
    smm = importlib.import_module("sd_kernels.ops.softmax_matmul")
    gn.use_kernel = smm.use_kernel = lambda *args, **kwargs: True  # CPU tensors, launched as on a GPU

    def group_norm(h, w, layout, shift=False):
        # 32 groups of 40 channels: one [64, 256] tile a group, whatever h·w ≤ 256
        x = torch.randn(2, 1280, h, w, dtype=torch.float16).contiguous(memory_format=layout)
        affine = torch.ones(1280, dtype=torch.float16)
        temb = torch.randn(2, 1280) if shift else None
        with cuda_standin.recording() as recorded:
            gn.group_norm(x, 32, affine, affine, activation="silu", shift=temb)
        return recorded

    def pixel_path(n, h, w, c=320, shift=False):
        # the channels-fast path (c=320: SDXL's widest level; its statistics chunk count follows the batch)
        x = torch.randn(n, c, h, w, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        temb = torch.randn(n, c) if shift else None
        with cuda_standin.recording() as recorded:
            gn.group_norm(x, 32, pixels=True, shift=temb)
        return recorded

    def softmax_matmul(rows):
        x, w = torch.randn(1, rows, 256, dtype=torch.float16), torch.randn(1, 256, 64, dtype=torch.float16)
        with cuda_standin.recording() as recorded:
            smm.softmax_matmul(x, w)
        return recorded

    nchw = group_norm(8, 8, torch.contiguous_format)
    launchers = {v.name: v for v in vars(gn).values() if isinstance(v, gn.Launcher)}
    ptx = launchers[json.loads(nchw[-1])["name"]].jit.preload(nchw[-1]).asm["ptx"]  # compiled for sm_90
    print(json.dumps({
        "group_norm": [group_norm(8, 8, torch.channels_last), group_norm(6, 10, torch.channels_last)],
        "one_tile_sizes": [group_norm(8, 8, torch.channels_last), group_norm(16, 16, torch.channels_last),
                           group_norm(12, 8, torch.channels_last, shift=True)],
        "pixel_channels": [pixel_path(2, 32, 32, 640), pixel_path(2, 32, 32, 960, shift=True)],
        "softmax_matmul": [softmax_matmul(112), softmax_matmul(120)],
        "pixel_path": [pixel_path(2, 128, 128), pixel_path(8, 104, 152)],
        "nchw": nchw, "nchw_stores": sorted(set(re.findall(r"st\\.global[.\\w]*", ptx))),
    }))
""")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return cuda_standin.run(SCRIPT, env={"TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton"))})


def _names(launches: list[str]) -> list[str]:
    return [json.loads(data)["name"].rpartition(".")[2] for data in launches]


def _differences(a: str, b: str) -> dict:
    """The fields (attributes by argument index) where two launches' specialization data differ."""
    a, b = json.loads(a), json.loads(b)
    first, second = (dict(zip(map(str, d["attrs_keys"]), d["attrs_vals"])) for d in (a, b))
    out = {k: (first.get(k), second.get(k)) for k in first.keys() | second.keys() if first.get(k) != second.get(k)}
    out.update({k: (a[k], b[k]) for k in a if k not in ("attrs_keys", "attrs_vals", "key") and a[k] != b.get(k)})
    return out


@pytest.mark.parametrize("op, kernels", [
    ("group_norm", ["_group_norm_tile_kernel"]),
    ("softmax_matmul", ["_row_stats_kernel", "_softmax_matmul_kernel"]),
])
def test_launches_differing_only_in_a_sizes_divisibility_share_a_kernel(recorded, op, kernels):
    """GroupNorm at 8×8 and 6×10 pixels (HW 64 and 60: one 64×64 tile a group), the partial softmax at
    112 and 120 rows of X (its row count and the stats' stride): the same specialization each."""
    first, second = recorded[op]
    assert _names(first) == _names(second) == kernels
    for a, b in zip(first, second):
        assert a == b, f"{_names([a])[0]}: {_differences(a, b)}"


def test_the_pixel_paths_merge_is_one_kernel_at_every_size_and_batch(recorded):
    """GroupNorm's pixel path at 128² × 2 and 104×152 × 8 (SDXL's widest level at 1024² with guidance,
    then 832×1216 at four images): a different number of statistics chunks per sample, one merge kernel."""
    first, second = recorded["pixel_path"]
    assert _names(first) == _names(second) == ["_pixel_stats_kernel", "_pixel_merge_kernel", "_pixel_norm_kernel"]
    assert first[1] == second[1], _differences(first[1], second[1])


def test_one_tile_groups_of_every_size_and_their_shifted_calls_share_a_kernel(recorded):
    """GroupNorm's one-tile path at 8×8, 16×16 and (with a shift, as a ResNet's time embedding) 12×8
    pixels: the groups pad to 64, 256 and 128 pixels, but the tile is the largest one of 40 channels,
    and the shift a run-time flag: one kernel for all three (a new image size compiles nothing here)."""
    launches = recorded["one_tile_sizes"]
    assert all(_names(x) == ["_group_norm_tile_kernel"] for x in launches)
    for other in launches[1:]:
        assert launches[0] == other, _differences(launches[0][0], other[0])


def test_pixel_path_layers_whose_channels_pad_alike_share_kernels(recorded):
    """The pixel path at 640 and 960 channels (32 groups of 20 and 30 channels, both padded to 1024 and 32),
    the second shifted: the group size and the shift are run-time arguments, so statistics, merge and
    normalize are one kernel each for both layers."""
    first, second = recorded["pixel_channels"]
    assert _names(first) == _names(second) == ["_pixel_stats_kernel", "_pixel_merge_kernel", "_pixel_norm_kernel"]
    for a, b in zip(first, second):
        assert a == b, f"{_names([a])[0]}: {_differences(a, b)}"


def test_an_nchw_one_tile_group_keeps_its_vector_stores(recorded):
    """8×8 NCHW: the pixels are the contiguous axis and HW = 64 a multiple of 16, so the tile's stores
    (the kernel's only ones) are 16-byte vectors, as when the kernel specialized HW itself."""
    assert _names(recorded["nchw"]) == ["_group_norm_tile_kernel"]
    assert recorded["nchw_stores"] and all(re.fullmatch(r"st\.global\.v4\.b32", s) for s in recorded["nchw_stores"]), (
        recorded["nchw_stores"])
