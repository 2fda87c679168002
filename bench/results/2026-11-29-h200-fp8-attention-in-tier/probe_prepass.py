"""The FP8 attention's K/V pre-pass at the models' shapes: the kernels as they were (a copy of the module
before the change, sd_kernels/ops/attention_fp8_before.py, untracked) against the present ones, the same
bits checked, and the present kernels' launch constants swept. Times: triton.testing.do_bench (L2 flushed
between runs), median, µs; GB/s on the bytes the two passes must move (K and V read twice, K8 and V8
written once)."""
import importlib
import itertools
import sys

import torch
from triton.testing import do_bench

from sd_kernels.runtime.launch import Launcher

new = importlib.import_module("sd_kernels.ops.attention_fp8")
try:
    old = importlib.import_module("sd_kernels.ops.attention_fp8_before")
except ImportError:
    old = None

SHAPES = {"flux": (1, 24, 4608, 128), "sd3": (2, 24, 4429, 64), "sdxl": (2, 10, 4096, 64)}


def bench(mod, k, v, qk, perm):
    fn = lambda: mod.quantize_kv(k, v, qk, "fp8", permute_v=perm)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype.itemsize == 1 else torch.equal(x, y)
               for x, y in zip(a, b))


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (B, H, S, D) in SHAPES.items():
        k = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) + 0.2
        v = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        moved = 2 * (2 * k.numel() * 2) + 2 * k.numel()
        for qk in ("int8", "fp8"):
            a = new.quantize_kv(k, v, qk, "fp8", permute_v=True)
            line = f"{name} {qk}:"
            if old is not None:
                b = old.quantize_kv(k, v, qk, "fp8", permute_v=True)
                t_old = bench(old, k, v, qk, True)
                line += f" same bits {same(a, b)}; before {t_old:.1f} us ({moved / t_old / 1e3:.0f} GB/s);"
            t_new = bench(new, k, v, qk, True)
            print(line, f"now {t_new:.1f} us ({moved / t_new / 1e3:.0f} GB/s)", flush=True)
        # sweep the present kernels' launch constants (int8 K, Hopper order)
        best = []
        a = new.quantize_kv(k, v, "int8", "fp8", permute_v=True)
        for rows, sw, step, qw in itertools.product((128, 256, 512), (4, 8), (32, 64), (4, 8)):
            new.STATS_ROWS, new.STATS_WARPS, new.STATS_STEP, new.QUANT_WARPS = rows, sw, step, qw
            new._STATS, new._QUANT = Launcher(new._kv_stats_kernel), Launcher(new._kv_quant_kernel)
            c = new.quantize_kv(k, v, "int8", "fp8", permute_v=True)
            # V8 the same bits; K8 within one code (the mean's sum runs in other chunks)
            ok = same(c[2:], a[2:]) and (c[0].int() - a[0].int()).abs().max().item() <= 1
            t = bench(new, k, v, "int8", True)
            best.append((t, rows, sw, step, qw, ok))
        best.sort()
        for t, rows, sw, step, qw, ok in best[:6]:
            print(f"  {name} STATS_ROWS={rows} STATS_WARPS={sw} STATS_STEP={step} QUANT_WARPS={qw}: {t:.1f} us"
                  f" (as the defaults': {ok})", flush=True)
        new.STATS_ROWS, new.STATS_WARPS, new.STATS_STEP, new.QUANT_WARPS = 256, 4, 32, 4
        new._STATS, new._QUANT = Launcher(new._kv_stats_kernel), Launcher(new._kv_quant_kernel)


if __name__ == "__main__":
    sys.exit(main())
