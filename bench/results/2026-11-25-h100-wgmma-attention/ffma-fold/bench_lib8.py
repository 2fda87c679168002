"""GPU (call 8): the library's wgmma kernel with the scale folded into one FFMA (B), against call 4's
kernel (A, scratch/gl/fa.py ping-pong), B with a 4-stage ring, and cuDNN, at the DiTs' shapes."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scratch/gl"))
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from bench.common import rotating, time_graph_ms
from sd_kernels import reference
from sd_kernels.ops import attention_wgmma as wg
from sd_kernels.testing import rel_err
import fa

OUT = os.environ.get("OUT", "/tmp") + "/r"
os.makedirs(OUT, exist_ok=True)


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def b4(q, k, v):
    wg.STAGES = 4
    try:
        return wg.attention_wgmma(q, k, v)
    finally:
        wg.STAGES = 3


def qkv(b, h, sq, sk, d, dtype):
    mk = lambda s: torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    return mk(sq), mk(sk), mk(sk)


rows = []
for shape in [(2, 16, 4096, 4096, 72), (2, 24, 4429, 4429, 64)]:
    inputs = qkv(*shape, torch.float16)
    ref = reference.attention(*(t.double() for t in inputs))
    impls = {"cudnn": cudnn, "B_ffma": lambda q, k, v: wg.attention_wgmma(q, k, v),
             "A_call4": lambda q, k, v: fa.attention(q, k, v, BLOCK_N=128, NS=3, SCHED=3), "B_4stages": b4}
    errs = {n: rel_err(f(*inputs), ref) for n, f in impls.items()}
    del ref
    nxt = rotating(lambda: qkv(*shape, torch.float16), sum(t.numel() * 2 for t in inputs))
    ms = {}
    for rep in range(2):  # interleaved twice: the order's effect shows
        for n, f in impls.items():
            ms.setdefault(n, []).append(time_graph_ms(lambda f=f: f(*nxt())))
    row = dict(shape="x".join(map(str, shape)), ms=ms, errors=errs)
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(OUT + "/ops_ffma.json", "w"), indent=1)
