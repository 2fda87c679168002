"""How much of PixArt-Σ's step is the cross-attention over T5's 300 padded tokens, and what trimming
the padding (exact: masked keys add exp(-10000) = 0) would save. Device times from CUDA graphs."""
import os, sys, json
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from bench.common import time_graph_ms
from sd_kernels import patch
from sd_kernels.models import build_model

out = sys.argv[1]
torch.manual_seed(0)
dev, dt = "cuda", torch.float16
rows = []
# 1. the cross-attention alone, as diffusers hands it over: q [2,16,4096,72] (a view of [B,S,H,D]),
#    k/v over L tokens, the additive mask [2,16,1,L] (prepare_attention_mask repeats it per head)
q = torch.randn(2, 4096, 16, 72, device=dev, dtype=dt).transpose(1, 2)
for L in (300, 256, 128, 64, 32):
    k = torch.randn(2, L, 16, 72, device=dev, dtype=dt).transpose(1, 2)
    v = torch.randn(2, L, 16, 72, device=dev, dtype=dt).transpose(1, 2)
    valid = min(L, 20)
    bias = torch.zeros(2, 16, 1, L, device=dev, dtype=dt)
    bias[..., valid:] = -10000.0
    ms_mask = time_graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    ms_nomask = time_graph_ms(lambda: F.scaled_dot_product_attention(q, k, v))
    r = {"what": "sdpa cross-attn", "L": L, "ms_masked": round(ms_mask, 4), "ms_unmasked": round(ms_nomask, 4)}
    print(r, flush=True); rows.append(r)
# exactness: trimmed vs full (masked) attention
k = torch.randn(2, 300, 16, 72, device=dev, dtype=dt).transpose(1, 2)
v = torch.randn(2, 300, 16, 72, device=dev, dtype=dt).transpose(1, 2)
bias = torch.zeros(2, 16, 1, 300, device=dev, dtype=dt); bias[0, ..., 20:] = -10000.0; bias[1, ..., 1:] = -10000.0
full = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
trim = F.scaled_dot_product_attention(q, k[:, :, :32], v[:, :, :32], attn_mask=bias[..., :32])
e = lambda a: ((a.double() - ref).norm() / ref.norm()).item()
r = {"what": "exactness vs float64", "full_masked_300": e(full), "trimmed_32": e(trim)}
print(r, flush=True); rows.append(r)

# 2. the whole transformer step (patched, replayed), at L = 300 and trimmed
tr = build_model("pixart-sigma", "transformer", dev, dt)
patch(tr, cuda_graph=False)
lat = torch.randn(2, 4, 128, 128, device=dev, dtype=dt)
t = torch.full((2,), 500, device=dev, dtype=torch.int64)
ehs_full = torch.randn(2, 300, 4096, device=dev, dtype=dt)
mask_full = torch.zeros(2, 300, device=dev, dtype=torch.int64); mask_full[0, :20] = 1; mask_full[1, :1] = 1
with torch.no_grad():
    ref_out = None
    for L in (300, 128, 64, 32):
        ehs, m = ehs_full[:, :L].contiguous(), mask_full[:, :L].contiguous()
        fn = lambda: tr(lat, encoder_hidden_states=ehs, encoder_attention_mask=m, timestep=t,
                        added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
        o = fn().float()
        if ref_out is None:
            ref_out = o
        ms = time_graph_ms(fn)
        r = {"what": "transformer step (patched, graphed)", "L": L, "ms": round(ms, 3),
             "rel_diff_vs_300": ((o - ref_out).norm() / ref_out.norm()).item()}
        print(r, flush=True); rows.append(r)
json.dump(rows, open(f"{out}/xattn.json", "w"), indent=1)
