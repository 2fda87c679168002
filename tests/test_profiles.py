import dataclasses
import json
import pathlib
import re
import types

import pytest
import torch

from sd_kernels import profiles
from sd_kernels.analysis.selection import selection_table
from sd_kernels.profiles import ProfileError

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOBILE = ("s23-ultra", "iphone-14-pro-max", "mobile-small")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("SD_KERNELS_PROFILE", raising=False)
    monkeypatch.setattr(profiles, "_active", None)


def device(name, major, minor, sms=132):
    return types.SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms)


# ---------------------------------------------------------------------------------------------
# The catalog


def test_catalog_has_every_class():
    assert set(profiles.list_profiles()) == {"hopper", "ampere", "consumer", "cuda", "cpu", *MOBILE}


@pytest.mark.parametrize("name", profiles.list_profiles())
def test_every_catalog_file_loads_round_trips_and_is_sane(name):
    path = pathlib.Path(profiles.__file__).parent / f"{name}.json"
    p = profiles.load_file(path)
    assert p == profiles.get_profile(name)
    assert profiles.from_dict(json.loads(json.dumps(p.describe()))) == p  # describe() is the file format
    if name in MOBILE:  # emulations: a budget, chunking, no detection, every number documented
        assert p.match is None and p.memory_budget_mb and p.intermediate_budget_mb and p.shared_memory_kb
        assert name in (ROOT / "docs" / "profiles.md").read_text()
    # 8-bit kept activations only where the decode's dtype cannot hold a 512² one (64 MiB) beside a band
    assert p.stream_pack8 == (name == "mobile-small")


def test_every_op_a_profile_can_disable_is_one_dispatch_is_asked_about():
    asked = set()
    for path in (ROOT / "sd_kernels" / "ops").glob("*.py"):
        asked |= set(re.findall(r'(?:use_kernel|disabled_reason)\(\s*"(\w+)"', path.read_text()))
    assert asked == set(profiles.KNOWN_OPS)


def test_winograd_tiles_match_the_op():
    from sd_kernels.ops.winograd import TILES

    assert tuple(profiles.WINOGRAD_TILES) == tuple(TILES)


@pytest.mark.parametrize("patch, message", [
    ({"colour": "red"}, "unknown key"),
    ({"memory_budget_mb": -1}, "memory_budget_mb"),
    ({"memory_budget_mb": "4 GB"}, "memory_budget_mb"),
    ({"shared_memory_kb": 100000}, "shared_memory_kb"),
    ({"attention": "fast"}, "attention"),
    ({"flash_block": [48, 32]}, "flash_block"),
    ({"disabled_ops": ["gelu", "flash"]}, "disabled_ops"),
    ({"winograd": [{"n": 2, "c": 1, "h": 1, "w": 1, "k": 1, "dtype": "float16", "tile": 3}]}, "winograd"),
    ({"winograd": [{"n": 2, "c": 1, "h": 1, "w": 1, "k": 1, "dtype": "float16"}]}, "lacks"),
    ({"match": {"capability": [[9, 0], [8, 0]]}}, "capability"),
    ({"match": {"capability": [[9, 0], [9, 9]], "sm": 3}}, "unknown key"),
    ({"intermediate_budget_mb": 5000, "memory_budget_mb": 4096}, "intermediate_budget_mb"),
    ({"autotune_cache": 5}, "autotune_cache = 5; expected a directory path"),
    ({"autotune_cache": "{oops}"}, "only placeholder is {name}"),
    ({"winograd": 5}, "winograd = 5; expected a list of rules"),
    ({"disabled_ops": [["x"]]}, "disabled_ops"),
    ({"description": "x" * 300_000}, "at most 2000 characters"),
    ({"stock_attention_head_dims": 72}, "stock_attention_head_dims = 72; expected a list of head dims"),
    ({"stock_attention_head_dims": [72, "80"]}, "stock_attention_head_dims"),
    ({"gelu_epilogue": 1}, "gelu_epilogue = 1; expected true or false"),
    ({"fp8_torch_gemm": "yes"}, "fp8_torch_gemm = 'yes'; expected true or false"),
    ({"stream_pack8": "yes"}, "stream_pack8 = 'yes'; expected true or false"),
    ({"stock_attention_ragged_keys": "4096"}, "stock_attention_ragged_keys"),
])
def test_bad_profile_data_is_a_clear_error(patch, message):
    data = {"name": "mine", "description": "a test", **patch}
    with pytest.raises(ProfileError, match=message):
        profiles.from_dict(data, "mine.json")


@pytest.mark.parametrize("content, message", [("[" * 100_000 + "]" * 100_000, "RecursionError"),
                                              (" " * (2 << 20), "a profile is at most")])
def test_a_pathological_profile_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "mine.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        profiles.load_file(path)


def test_stock_attention_head_dims_route_only_those_to_sdpa():
    """hopper lists PixArt-Σ's 72 and FLUX's 128 (cuDNN measured faster than our flash there); SD's
    40/80/160 stay flash; a forced policy still wins over the list. 64's and 72's long attention goes
    to the wgmma kernel first (its list is checked before this one); without it 64 is flash."""
    hopper = profiles.get_profile("hopper")
    assert hopper.stock_attention_head_dims == (72, 128)
    assert hopper.wgmma_attention_head_dims == (64, 72)
    assert hopper.attention_choice(4096, 4096, 72)[0] == "flash_wgmma"
    assert hopper.attention_choice(4096, 4096, 72, wgmma=False)[0] == "sdpa"
    assert hopper.attention_choice(4096, 300, 72)[0] == "sdpa"
    assert hopper.attention_choice(4608, 4608, 128)[0] == "sdpa"
    assert [hopper.attention_choice(4096, 4096, d)[0] for d in (40, 64, 80, 160)] == ["flash", "flash_wgmma",
                                                                                       "flash", "flash"]
    assert hopper.attention_choice(4096, 4096, 64, wgmma=False)[0] == "flash"
    assert dataclasses.replace(hopper, attention="flash").attention_choice(4096, 4096, 72)[0] == "flash"
    saved = json.loads(json.dumps(hopper.describe()))  # what `sd-kernels info` prints, as a JSON file holds it
    assert profiles.from_dict(saved, "x.json") == hopper


def test_stock_attention_fp32_head_dims_route_only_fp32_calls():
    """hopper sends fp32 attention at head dim 512 (the VAE's mid-block in SDXL's fp32 decode) to stock SDPA; the
    same head dim in fp16 or bf16 and fp32 at other head dims keep the path they took."""
    hopper = profiles.get_profile("hopper")
    assert hopper.stock_attention_fp32_head_dims == (512,)
    assert hopper.attention_choice(16384, 16384, 512, "float32")[0] == "sdpa"
    for dtype in ("float16", "bfloat16"):
        assert hopper.attention_choice(16384, 16384, 512, dtype)[0] == "partial_softmax"
    assert hopper.attention_choice(4096, 4096, 160, "float32")[0] == "flash"
    assert dataclasses.replace(hopper, stock_attention_fp32_head_dims=()).attention_choice(
        16384, 16384, 512, "float32")[0] == "partial_softmax"


def test_stock_attention_ragged_keys():
    """hopper, for a call the wgmma kernel cannot take: 1,024 keys or more that are not a multiple of 64
    (SD3's joint 4,429) go to stock SDPA; SD's cross-attention (77 keys), SD2.1's 144 and every multiple
    of 64 stay ours."""
    hopper = profiles.get_profile("hopper")
    assert hopper.stock_attention_ragged_keys == 1024
    path = lambda sk: hopper.attention_choice(4096, sk, 64, wgmma=False)[0]  # noqa: E731
    assert path(4429) == "sdpa" and "4429 keys" in hopper.attention_choice(4096, 4429, 64, wgmma=False)[1]
    assert [path(sk) for sk in (77, 144, 1000, 1024, 4096, 4160)] == ["flash"] * 6
    assert profiles.get_profile("cuda").stock_attention_ragged_keys is None
    with pytest.raises(ProfileError, match="stock_attention_ragged_keys"):
        dataclasses.replace(hopper, stock_attention_ragged_keys=0)


def test_profile_is_frozen_and_replace_validates():
    p = profiles.get_profile("hopper")
    q = dataclasses.replace(p, attention="partial_softmax")
    assert q.attention == "partial_softmax" and p.attention == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.attention = "sdpa"
    with pytest.raises(ProfileError, match="attention"):
        dataclasses.replace(p, attention="naive")


# ---------------------------------------------------------------------------------------------
# Detection and precedence


@pytest.mark.parametrize("dev, name", [
    (None, "cpu"),
    (device("NVIDIA H100 80GB HBM3", 9, 0), "hopper"),
    (device("NVIDIA H100 PCIe", 9, 0, 114), "hopper"),
    (device("NVIDIA H200", 9, 0), "hopper"),
    (device("NVIDIA A100-SXM4-80GB", 8, 0, 108), "ampere"),
    (device("NVIDIA A10", 8, 6, 72), "ampere"),
    (device("NVIDIA GeForce RTX 4090", 8, 9, 128), "consumer"),
    (device("NVIDIA GeForce RTX 3060", 8, 6, 28), "consumer"),
    (device("NVIDIA A1000 Laptop GPU", 8, 6, 16), "consumer"),  # "A10" must not match inside a word
    (device("Tesla V100-SXM2-16GB", 7, 0, 80), "cuda"),
    (device("Tesla T4", 7, 5, 40), "cuda"),
    (device("NVIDIA B200", 10, 0, 148), "cuda"),
    (device("Tesla P100", 6, 0, 56), "cpu"),  # below what Triton supports
])
def test_detection_from_device_properties(dev, name):
    assert profiles.detect_profile(dev).name == name


def test_min_sms_is_part_of_a_match():
    m = profiles.Match(((9, 0), (9, 9)), min_sms=100)
    assert m.fits("x", (9, 0), 132) and not m.fits("x", (9, 0), 66)


def test_precedence_argument_then_environment_then_detection(monkeypatch, tmp_path):
    monkeypatch.setattr(profiles, "detect_profile", lambda dev: profiles.get_profile("consumer"))
    assert profiles.get_profile().name == "consumer"
    monkeypatch.setenv("SD_KERNELS_PROFILE", "s23-ultra")
    assert profiles.get_profile().name == "s23-ultra"
    assert profiles.get_profile("hopper").name == "hopper"
    mine = dataclasses.replace(profiles.get_profile("hopper"), name="mine", attention="sdpa")
    assert profiles.get_profile(mine) is mine
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine.describe()))
    assert profiles.get_profile(str(path)) == mine
    assert profiles.set_profile(None).name == "s23-ultra" and profiles.active_profile().name == "s23-ultra"
    assert profiles.set_profile(mine) is profiles.active_profile() is mine


def test_unknown_profile_lists_known():
    with pytest.raises(ValueError, match="hopper"):
        profiles.get_profile("mali")
    with pytest.raises(TypeError, match="name, a Profile or None"):
        profiles.get_profile(3)


# ---------------------------------------------------------------------------------------------
# Decisions


@pytest.mark.parametrize("name, flash_dims", [
    ("hopper", {40, 80, 160, 256}), ("ampere", {40, 80, 160}), ("cuda", {40, 80, 160}),
    ("s23-ultra", {40}), ("iphone-14-pro-max", {40}), ("mobile-small", set()),
])
def test_flash_only_where_on_chip_memory_allows(name, flash_dims):
    p = profiles.get_profile(name)
    got = {d for d in (40, 64, 80, 128, 160, 256, 512) if p.attention_path(4096, 4096, d) == "flash"}
    assert got & {40, 80, 160, 256, 512} == flash_dims


def test_mobile_keeps_the_partial_softmax_for_few_keys():
    p = profiles.get_profile("s23-ultra")
    assert p.attention_path(4096, 77, 40) == "partial_softmax"
    assert p.attention_path(4096, 4096, 40) == "flash"
    assert profiles.get_profile("hopper").attention_path(4096, 77, 40) == "flash"


@pytest.mark.parametrize("policy", ["flash", "partial_softmax", "sdpa"])
def test_explicit_policy_wins(policy):
    p = dataclasses.replace(profiles.get_profile("s23-ultra"), attention=policy)
    assert {p.attention_path(256, 256, d) for d in (40, 160, 512)} == {policy}


WINOGRAD_RESULTS = ("bench/results/2026-11-22-h100-ops/ops.csv", "bench/results/2026-11-22-h100-ops/winograd_deep.csv",
                    "bench/results/2026-11-23-h100-unet-nhwc-winograd/winograd_unet.csv")  # later files win


def test_hopper_routes_winograd_exactly_where_it_was_measured_to_win():
    """hopper's Winograd table is the set of measured NCHW shapes where one of our tiles beats cuDNN on
    the same input layout by the margin (device time, the H100 results in the repo), each with its
    fastest tile: nothing unmeasured, no loss, no win left out; no channels_last route (they lose
    inside the UNet, next test)."""
    import pathlib

    from bench.winograd_routes import BASELINE, LAYOUTS, MARGIN, OURS, measured

    hopper = profiles.get_profile("hopper")
    table = measured([pathlib.Path(__file__).parents[1] / f for f in WINOGRAD_RESULTS])
    assert len(table) >= 20
    for (shape, dtype, layout), ms in table.items():
        ours = {tile: ms[impl] for impl, tile in OURS.items() if impl in ms}
        best = min(ours, key=ours.get)
        want = best if layout in LAYOUTS and ms[BASELINE[layout]] >= MARGIN * ours[best] else None
        assert hopper.winograd_tile(*shape, dtype, layout) == want, (shape, layout, ms)
    routed = {((r.n, r.c, r.h, r.w, r.k), r.dtype, r.layout) for r in hopper.winograd}
    assert routed <= set(table)
    assert hopper.routes_winograd(1280, 1280) and not hopper.routes_winograd(320, 320)
    assert hopper.winograd_tile(2, 1280, 16, 16, 1280, "float16") == 2
    assert not any(hopper.routes_winograd(r.c, r.k, "channels_last") for r in hopper.winograd)
    assert hopper.winograd_tile(1, 1280, 16, 16, 1280, torch.float16) is None  # batch 1: not measured
    assert hopper.winograd_tile(2, 1280, 16, 16, 1280, torch.bfloat16) is None  # not measured
    off = dataclasses.replace(hopper, disabled_ops=frozenset({"winograd_conv2d"}))
    assert off.winograd_tile(2, 1280, 16, 16, 1280, torch.float16) is None
    assert not off.routes_winograd(1280, 1280)
    for name in set(profiles.list_profiles()) - {"hopper"}:
        assert profiles.get_profile(name).winograd == ()


def test_channels_last_winograd_was_measured_to_lose_inside_the_unet():
    """Why hopper routes no channels_last conv: the in-situ measurement in the repo (SD1.5 UNet step
    from a CUDA graph on the H100, with every deep conv routed vs none, eager and compiled)."""
    import csv
    import json
    import pathlib

    folder = pathlib.Path(__file__).parents[1] / "bench/results/2026-11-23-h100-unet-nhwc-winograd"
    run = folder / "unet_kernels-cl-routes.json"
    steps = {s["setup"]: s for s in json.loads(run.read_text())["setups"]}
    assert steps["patched"]["winograd_routing_per_call"] == {"channels_last F(2,3)": 29}
    assert steps["patched-no-winograd"]["step_ms"] < steps["patched"]["step_ms"]
    # compiled: the end-to-end run with every deep conv routed channels_last (same machine)
    with open(run.with_name("e2e-sd15-cl-routes.csv")) as f:
        routed = {r["variant"]: float(r["unet_device_ms"]) for r in csv.DictReader(f)}["patched+graph+compile"]
    assert steps["patched-compile-no-winograd"]["step_ms"] < routed


def test_chunk_bytes_follow_the_intermediate_budget():
    assert profiles.get_profile("hopper").chunk_bytes() == profiles.DEFAULT_CHUNK_BYTES
    assert profiles.get_profile("s23-ultra").chunk_bytes() == 84 * 2**20 // profiles.CHUNK_SHARE


# ---------------------------------------------------------------------------------------------
# The selection table


def _kernels(name):
    return [(r.op, r.shape.split()[-1] if r.op != "attention" else r.shape, r.kernel)
            for r in selection_table(profiles.get_profile(name))]


def test_selection_table_is_stable_and_pinned():
    assert _kernels("s23-ultra") == _kernels("s23-ultra")
    attn = lambda name: [k for op, _, k in _kernels(name) if op == "attention"]
    # self/cross at 64², 32², 16², then the VAE's D = 512, then PixArt's self/cross, SD3's and FLUX's joint
    assert attn("hopper") == (["flash"] * 6 + ["partial_softmax"] + ["flash_wgmma"] + ["sdpa (stock)"]
                              + ["flash_wgmma"] + ["sdpa (stock)"])
    assert attn("s23-ultra") == ["flash"] + ["partial_softmax"] * 10
    assert attn("mobile-small") == ["partial_softmax"] * 11
    gelus = lambda name: {k for op, _, k in _kernels(name) if op == "gelu tanh"}  # noqa: E731
    assert gelus("hopper") == {"cuBLASLt linear + GELU epilogue"} and gelus("cuda") == {"cuBLAS linear + gelu"}
    fp8 = lambda name: [k.split()[0] for op, _, k in _kernels(name) if op == "fp8 gemm"]  # noqa: E731
    # FLUX's q, k, v and gated down-projection (bf16, thousands of rows) and SD3's fp16 ones on cuBLASLt where the
    # profile measured it; FLUX's one-row modulation on ours everywhere
    assert fp8("hopper") == ["torch._scaled_mm", "torch._scaled_mm", "our", "torch._scaled_mm"]
    assert fp8("cuda") == ["our"] * 4 and fp8("consumer") == ["our"] * 4  # on sm_89 or later (Ada), the why says
    pre_fp8 = dataclasses.replace(profiles.get_profile("ampere"),
                                  match=dataclasses.replace(profiles.get_profile("ampere").match,
                                                            capability=((8, 0), (8, 6))))
    assert {r.kernel for r in selection_table(pre_fp8) if r.op == "fp8 gemm"} == {"none: the tier refuses these GPUs"}
    convs = [k for op, _, k in _kernels("hopper") if op == "conv3x3"]
    # (nchw, nhwc) per shape: 320@64², 640@32², 1280@16², 1280@8², then the VAE's 512@64², 128@512²
    assert convs == (["F.conv2d (stock)"] * 2 + ["winograd F(4,3)", "F.conv2d (stock)"]
                     + ["winograd F(2,3)", "F.conv2d (stock)"] * 2 + ["F.conv2d (stock)"] * 4)
    off = dataclasses.replace(profiles.get_profile("hopper"), disabled_ops=frozenset(profiles.KNOWN_OPS))
    assert {r.kernel.split()[-1] for r in selection_table(off)} == {"(stock)"}


def test_attention_follows_the_active_profile(monkeypatch):
    from sd_kernels.ops import attention as attn_mod

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.zeros(1, 1, 2048, 80)
    profiles.set_profile("hopper")
    assert attn_mod.attention_path(q, q, q) == "flash"
    profiles.set_profile("s23-ultra")
    assert attn_mod.attention_path(q, q, q) == "partial_softmax"
    assert attn_mod.partial_softmax_chunk_bytes() == 21 * 2**20
    profiles.set_profile(dataclasses.replace(profiles.get_profile("hopper"), attention="sdpa"))
    assert attn_mod.attention_path(q, q, q) == "sdpa"
