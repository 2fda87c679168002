"""The FP8 attention's K/V quantization pass alone (statistics given, as FLUX's q/k norm + RoPE hands them
over), per program shape (key blocks a program, tile loaded before the partials) and warps, at FLUX's shapes;
then the whole FP8 attention (pass + Hopper kernel) against our exact attention, in one process."""
import importlib
import itertools
import json
import os
import sys

import torch

from bench import common

fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")
attn = importlib.import_module("sd_kernels.ops.attention")
out = {}
for name, (b, h, s, d) in [("FLUX 1024²", (1, 24, 4608, 128)), ("FLUX 1536²", (1, 24, 9728, 128))]:
    sets = []
    for _ in range(3):  # three sets in turn: 85 MB of K and V at FLUX 1024², more than the L2 holds
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        chunk = 128
        n = -(-s // chunk)
        kp = torch.nn.functional.pad(k.float(), (0, 0, 0, n * chunk - s)).reshape(b * h, n, chunk, d)
        vp = torch.nn.functional.pad(v.float(), (0, 0, 0, n * chunk - s)).reshape(b * h, n, chunk, d)
        k_sum, v_max = kp.sum(2).contiguous(), vp.abs().amax(2).contiguous()
        sets.append((q, k, v, fp8.KvStats.of(k.transpose(1, 2), v.transpose(1, 2), k_sum, v_max)))
    turn = itertools.cycle(range(3))

    def one_pass(t):
        return fp8.quantize_kv(t[1], t[2], "fp8", "fp8", permute_v=True, stats=t[3])

    q, k, v, stats = sets[0]
    assert all(t[3].serves(t[1], t[2]) for t in sets)
    ref = None
    for shape in [(1, False), (1, True), (2, True), (2, False), (4, True)]:
        for warps in (4, 8):
            fp8.QUANT_SHAPE, fp8.QUANT_WARPS = shape, warps
            got = fp8.quantize_kv(k, v, "fp8", "fp8", permute_v=True, stats=stats)
            bits = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in got]
            ref = ref or bits
            same = all(torch.equal(x, y) for x, y in zip(bits, ref))
            ms = common.time_graph_ms(lambda: one_pass(sets[next(turn)]), calls=6)
            bytes_ = 2 * k.numel() * 2 + 2 * k.numel()
            row = {"ms": round(ms, 5), "GB/s": round(bytes_ / ms / 1e6), "same_bits": same}
            out[f"{name} blocks={shape[0]} tile_first={shape[1]} warps={warps}"] = row
            print(name, shape, warps, row, flush=True)
    fp8.QUANT_SHAPE, fp8.QUANT_WARPS = (1, True), 4
    for label, fn in [("exact", lambda t: attn.attention(*t[:3])),
                      ("fp8, stats given", lambda t: fp8.attention_fp8(*t[:3], qk="fp8", kv_stats=t[3])),
                      ("fp8, stats pass", lambda t: fp8.attention_fp8(*t[:3], qk="fp8"))]:
        ms = common.time_graph_ms(lambda fn=fn: fn(sets[next(turn)]), calls=6)
        out[f"{name} attention {label}"] = round(ms, 5)
        print(name, label, round(ms, 5), flush=True)
json.dump({"env": common.environment(), "rows": out}, open(os.path.join(sys.argv[1], "kv_quant.json"), "w"), indent=1)
