"""GPU: the library's wgmma attention vs cuDNN SDPA and our Triton flash at the DiTs' shapes (CUDA-graph device time)."""
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from bench.common import rotating, time_graph_ms
from sd_kernels import reference
from sd_kernels.ops import flash_attention
from sd_kernels.ops import attention_wgmma as wg
from sd_kernels.testing import rel_err

OUT = os.environ.get("OUT", "/tmp") + "/r"
os.makedirs(OUT, exist_ok=True)


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def qkv(b, h, sq, sk, d, dtype):
    mk = lambda s: torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    return mk(sq), mk(sk), mk(sk)


rows = []
for shape, dtype in [((2, 16, 4096, 4096, 72), torch.float16), ((2, 16, 4096, 4096, 72), torch.bfloat16),
                     ((2, 24, 4429, 4429, 64), torch.float16), ((1, 24, 4608, 4608, 128), torch.float16),
                     ((2, 16, 4096, 300, 72), torch.float16),
                     ((2, 5, 4096, 4096, 64), torch.float16), ((2, 5, 9216, 9216, 64), torch.float16),
                     ((2, 10, 1024, 1024, 64), torch.float16)]:
    inputs = qkv(*shape, dtype)
    ref = reference.attention(*(t.double() for t in inputs))
    impls = {"cudnn": cudnn, "wgmma": lambda q, k, v: wg.attention_wgmma(q, k, v), "triton_flash": flash_attention}
    errs = {n: rel_err(f(*inputs), ref) for n, f in impls.items()}
    del ref
    nxt = rotating(lambda: qkv(*shape, dtype), sum(t.numel() * 2 for t in inputs))
    ms = {n: time_graph_ms(lambda f=f: f(*nxt())) for n, f in impls.items()}
    b, h, sq, sk, d = shape
    fl = 4 * b * h * sq * sk * d
    row = dict(shape="x".join(map(str, shape)), dtype=str(dtype), ms=ms, errors=errs,
               tflops={n: round(fl / t / 1e9, 1) for n, t in ms.items()}, wgmma_vs_cudnn=round(ms["cudnn"] / ms["wgmma"], 3))
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(OUT + "/ops_wgmma.json", "w"), indent=1)
print("versions", torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
