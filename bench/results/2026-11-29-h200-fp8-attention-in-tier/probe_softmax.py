"""The FP8 Hopper attention kernel's softmax variants at the models' shapes, in one process: the consumers'
token ring on or off (``attention_fp8_wgmma.PINGPONG``) and ``FAST_SOFTMAX`` 0 (the plain reductions, every
exponential on the MUFU), 1 (row maxima and sums in trees) and 2 (trees, and half the exponentials on the
FMA pipe), each with its pre-pass, beside our exact attention. Times: CUDA graphs over rotating inputs
(bench.common.time_graph_ms), ms; rel_err against SDPA on the fp32 upcast inputs."""
import functools
import importlib
import itertools

import torch
import torch.nn.functional as F

from bench import common
from sd_kernels.testing import rel_err

fp8 = importlib.import_module("sd_kernels.ops.attention_fp8")
hopper = importlib.import_module("sd_kernels.ops.attention_fp8_wgmma")
attn = importlib.import_module("sd_kernels.ops.attention")

VARIANTS = [(True, 0), (True, 1), (True, 2), (False, 0), (False, 2)]  # (PINGPONG, FAST_SOFTMAX)
SHAPES = {"FLUX": (1, 24, 4608, 128), "SD3": (2, 24, 4429, 64), "SDXL 64²": (2, 10, 4096, 64)}


def qkv(b, h, s, d):
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name, (b, h, s, d) in SHAPES.items():
        inputs = qkv(b, h, s, d)
        ref = F.scaled_dot_product_attention(*(t.float() for t in inputs))
        nxt = common.rotating(functools.partial(qkv, b, h, s, d), 3 * inputs[0].numel() * 2)
        exact = common.time_graph_ms(lambda nxt=nxt: attn.attention(*nxt()))
        print(f"{name}: ours exact {exact:.4f} ms", flush=True)
        for qk, nc, (pingpong, fast) in itertools.product(("fp8", "int8"), (2, 3), VARIANTS):
            if d == 128 and nc == 3:
                continue
            hopper.PINGPONG, hopper.FAST_SOFTMAX = pingpong, fast
            fn = functools.partial(fp8._attention_fp8, scale=d ** -0.5, qk=qk, pv="fp8", n_consumers=nc)
            try:
                err = rel_err(fn(*inputs), ref)
                ms = common.time_graph_ms(lambda fn=fn, nxt=nxt: fn(*nxt()))
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  {qk} nc={nc} pingpong={pingpong} fast={fast}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            print(f"  {qk} nc={nc} pingpong={pingpong} fast={fast}: {ms:.4f} ms ({exact / ms:.3f}x exact), "
                  f"rel_err {err:.3e}", flush=True)
        hopper.PINGPONG, hopper.FAST_SOFTMAX = True, 0
        del inputs, ref, nxt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
