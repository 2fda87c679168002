"""GPU: the wgmma attention with two or three consumer warpgroups vs cuDNN SDPA and our Triton flash, at
the DiTs' and the UNets' shapes (CUDA-graph device time, inputs rotated past the L2); errors vs float64."""
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


f16, bf16 = torch.float16, torch.bfloat16
cases = [("SD3 1024", (2, 24, 4429, 4429, 64), f16), ("SD3 1024", (2, 24, 4429, 4429, 64), bf16),
         ("SD3 512", (2, 24, 1357, 1357, 64), f16), ("PixArt 1024", (2, 16, 4096, 4096, 72), f16),
         ("PixArt 1024", (2, 16, 4096, 4096, 72), bf16), ("SD2 768", (2, 5, 9216, 9216, 64), f16),
         ("SD2 512", (2, 5, 4096, 4096, 64), f16), ("SDXL 4096", (2, 10, 4096, 4096, 64), f16),
         ("SDXL 1024", (2, 20, 1024, 1024, 64), f16), ("SD1.5 512", (2, 8, 4096, 4096, 40), f16),
         ("FLUX 1024", (1, 24, 4608, 4608, 128), f16)]
rows = []
for name, shape, dtype in cases:
    inputs = qkv(*shape, dtype)
    ref = reference.attention(*(t.double() for t in inputs))
    impls = {"cudnn": cudnn, "wgmma2": lambda q, k, v: wg.attention_wgmma(q, k, v, n_consumers=2),
             "wgmma3": lambda q, k, v: wg.attention_wgmma(q, k, v, n_consumers=3), "triton_flash": flash_attention}
    if shape[-1] == 128:  # three consumers spill at head dim 128 (ptxas: 832 bytes)
        del impls["wgmma3"]
    errs = {n: rel_err(f(*inputs), ref) for n, f in impls.items()}
    del ref
    nxt = rotating(lambda: qkv(*shape, dtype), sum(t.numel() * 2 for t in inputs))
    ms = {n: time_graph_ms(lambda f=f: f(*nxt())) for n, f in impls.items()}
    b, h, sq, sk, d = shape
    fl = 4 * b * h * sq * sk * d
    row = dict(case=name, shape="x".join(map(str, shape)), dtype=str(dtype), ms=ms, errors=errs,
               tflops={n: round(fl / t / 1e9, 1) for n, t in ms.items()},
               vs_cudnn={n: round(ms["cudnn"] / t, 3) for n, t in ms.items()})
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(OUT + "/ops_wgmma_nc.json", "w"), indent=1)
print("versions", torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
