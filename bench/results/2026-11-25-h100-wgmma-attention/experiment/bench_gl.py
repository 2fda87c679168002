"""GPU: the Gluon Hopper attention vs cuDNN / FA2 SDPA and our Triton flash, at the DiTs' shapes."""
import json, os, sys, traceback
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scratch/gl"))
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from bench.common import rotating, time_graph_ms
from sd_kernels import reference
from sd_kernels.ops import flash_attention
from sd_kernels.testing import rel_err
import fa

OUT = os.environ.get("OUT", "/tmp") + "/r"
os.makedirs(OUT, exist_ok=True)
rows = []


def sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def qkv(b, h, sq, sk, d, dtype=torch.float16):
    mk = lambda s: torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    return mk(sq), mk(sk), mk(sk)


SHAPES = [(2, 16, 4096, 4096, 72), (2, 24, 4429, 4429, 64), (1, 24, 4608, 4608, 128),
          (2, 16, 4096, 300, 72), (1, 3, 333, 77, 72), (2, 2, 200, 515, 40)]
CONFIGS = [(1, 128, 2), (1, 128, 3), (3, 128, 2), (3, 128, 3), (3, 64, 4)]
for shape in SHAPES:
    b, h, sq, sk, d = shape
    inputs = qkv(*shape)
    ref = reference.attention(*(t.double() for t in inputs))
    impls = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "fa2": sdpa(SDPBackend.FLASH_ATTENTION),
             "ours_triton": flash_attention}
    for sc, bn, ns in CONFIGS:
        impls[f"gl{sc}_bn{bn}_ns{ns}"] = (lambda q, k, v, sc=sc, bn=bn, ns=ns: fa.attention(q, k, v, BLOCK_N=bn, NS=ns,
                                                                                           SCHED=sc))
    errs, bad = {}, {}
    for name, fn in list(impls.items()):
        try:
            print("run", shape, name, flush=True)
            out = fn(*inputs)
            torch.cuda.synchronize()
            errs[name] = rel_err(out, ref)
        except Exception as exc:
            bad[name] = "".join(traceback.format_exception_only(exc)).strip()[-400:]
            del impls[name]
    del ref
    torch.cuda.empty_cache()
    big = sq * sk >= 1 << 20
    times = {}
    if big:
        nb = sum(t.numel() * 2 for t in inputs)
        nxt = rotating(lambda: qkv(*shape), nb)
        for name, fn in impls.items():
            try:
                times[name] = time_graph_ms(lambda fn=fn: fn(*nxt()))
            except Exception as exc:
                bad[name + "_time"] = str(exc)[-300:]
    flops = 4 * b * h * sq * sk * d
    row = dict(shape="x".join(map(str, shape)), errors=errs, failed=bad, ms=times,
               tflops={k: round(flops / v / 1e9, 1) for k, v in times.items()})
    rows.append(row)
    print(json.dumps(row), flush=True)
    del inputs
    torch.cuda.empty_cache()
json.dump(rows, open(OUT + "/gluon_attn.json", "w"), indent=1)
print("versions", torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
