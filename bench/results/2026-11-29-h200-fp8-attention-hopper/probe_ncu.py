"""Each Hopper attention kernel at FLUX.1's shape (1×24×4608×128, bf16), twice, for ncu (README.md has the
two commands: ``--launch-skip 1 --launch-count 1 -k regex:^_attn_wgmma_fwd``, then ``-k
regex:_attn_fp8_wgmma_fwd``; the skipped launch is the one that compiles). The exact wgmma kernel, then
``attention_fp8`` with its defaults (int8 Q·Kᵀ, e4m3 P·V), which the code of that run sent to the Hopper
kernel at head dim 128 (``kernel_choice`` now keeps int8 at 128 on the Triton kernel)."""
import importlib

import torch

from sd_kernels.ops import attention_fp8

wgmma = importlib.import_module("sd_kernels.ops.attention_wgmma")
q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
for _ in range(2):
    wgmma.attention_wgmma(q, k, v)
for _ in range(2):
    attention_fp8(q, k, v)
torch.cuda.synchronize()
