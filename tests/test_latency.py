"""sd_kernels.analysis.latency: the roofline model's op costs on small cases worked out by hand, and the SD1.5
trace against the FLOP counts REFERENCE.md gives (torch's FlopCounterMode)."""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from sd_kernels.analysis import latency
from sd_kernels.profiles import get_profile


def _prof(**kw):
    return dataclasses.replace(get_profile("s23-ultra"), **kw)


def test_roofline_is_the_slower_of_compute_and_memory():
    assert latency.roofline_s(4e12, 1.0, 4.0, 64.0) == pytest.approx(1.0)
    assert latency.roofline_s(1.0, 64e9, 4.0, 64.0) == pytest.approx(1.0)


def test_attention_costs_per_path():
    prof = _prof()
    b, h, n, d = 2, 8, 4096, 40
    scores = b * h * n * n * 2
    qo = kv = 2 * b * h * n * d * 2
    flash = latency._attention(h, d, b, n, n, prof)  # head dim 40 fits the phone's on-chip memory: flash
    assert flash["baseline"][1] == qo + kv + 10 * scores
    assert flash["optimized"][1] == qo + kv * math.ceil(n / prof.flash_block[0])
    partial = latency._attention(h, 80, b, n, n, prof)  # 80 does not fit: the partially fused softmax
    assert partial["optimized"][1] == 2 * qo + 2 * kv + 4 * scores  # Q/O and K/V at head dim 80: twice 40's
    assert flash["baseline"][0] == flash["optimized"][0] == 4.0 * b * h * n * n * d + 5.0 * b * h * n * n


def test_winograd_only_where_the_roofline_prefers_it():
    conv = nn.Conv2d(320, 320, 3, padding=1)
    x = y = (2, 320, 64, 64)
    fast_memory = latency._conv(conv, x, y, tflops=1.0, gbps=1e6)  # compute-bound: Winograd's 4x fewer multiplies
    direct = 2.0 * 2 * 320 * 64 * 64 * 320 * 9
    assert fast_memory["baseline"][0] == direct and fast_memory["optimized"][0] < direct / 3
    slow_memory = latency._conv(conv, x, y, tflops=1e6, gbps=1.0)  # memory-bound: its transformed tensors lose
    assert slow_memory["optimized"] == slow_memory["baseline"]
    one_by_one = latency._conv(nn.Conv2d(320, 640, 1), x, (2, 640, 64, 64), 1.0, 1e6)
    assert one_by_one["optimized"] == one_by_one["baseline"]


def test_group_norm_fuses_the_silu_after_it():
    seq = nn.Sequential(nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 8, 1), nn.SiLU()).to("meta")
    x = torch.zeros(1, 8, 4, 4, device="meta")
    ops = latency.trace(lambda: seq(x), seq, _prof(fp16_tflops=1.0, bandwidth_gbps=1.0))
    assert [op.kind for op in ops] == ["group_norm", "conv", "activation"]  # the second SiLU follows a conv
    n = 8 * 16 * 2
    assert ops[0].cost["baseline"][1] == 8 * n and ops[0].cost["optimized"][1] == 3 * n


@pytest.mark.integration
def test_sd15_trace_counts_the_references_flops_and_the_model_runs():
    prof = _prof(fp16_tflops=4.0, bandwidth_gbps=64.0)
    comps = {c.name: c for c in latency.sd_components("sd15", prof, steps=20)}
    gflop = {k: sum(op.cost["baseline"][0] for op in c.ops) / 1e9 for k, c in comps.items()}
    # REFERENCE.md (FlopCounterMode): 1,606 GFLOP per UNet call at batch 2, 2,515 for the decode;
    # ours adds softmax and normalization arithmetic
    assert 1606 <= gflop["unet"] <= 1606 * 1.02 and 2515 <= gflop["vae_decode"] <= 2515 * 1.02
    e = latency.estimate("sd15", prof)
    assert 0 < e["total"]["optimized"] < e["total"]["baseline"] and -1 < e["change"] < 0
    assert "not a measurement" in latency.format_estimate(e)


def test_a_profile_without_device_figures_is_a_clear_error():
    with pytest.raises(ValueError, match="no fp16_tflops"):
        latency.estimate("tiny", _prof(fp16_tflops=None))
