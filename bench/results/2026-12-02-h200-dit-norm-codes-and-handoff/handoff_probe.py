"""Which of the two switches moves the tiny bf16 FLUX's FP8 output, and do the two kernels round h alike."""
import sys
import torch
sys.path.insert(0, "tests/patches")
from sd_kernels.patches import codes_readers, dit_handoff
from sd_kernels.ops import layer_norm as L
from sd_kernels.ops.residual import gated_add
from sd_kernels.testing import rel_err
import sd_kernels
from test_fp8_patch import _model
from test_flux_patch import _inputs as flux_inputs

g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(1, 300, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 4
y = torch.randn(1, 300, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
gate = torch.randn(1, 1, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
sc = torch.randn(1, 1, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
sh = torch.randn(1, 1, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
h1 = gated_add(x, gate, y)
h2, yy, q2, s2 = L.gated_residual_layer_norm_fp8(x, y, gate, None, None, 1e-6, sc, sh)
y1, q1, s1 = L.layer_norm_modulated_fp8(h1, None, None, 1e-6, sc, sh)
print("h differs at", (h1 != h2).sum().item(), "of", h1.numel())
print("codes differ at", (q1.view(torch.uint8) != q2.view(torch.uint8)).sum().item(), "scales max rel",
      ((s1 - s2).abs() / s1).max().item(), "y differs at", (y1 != yy).sum().item())

model = _model("tiny-flux")
config = {**model.config, "num_layers": 4, "num_single_layers": 4, "attention_head_dim": 128,
          "axes_dims_rope": [16, 56, 56]}
for dtype in (torch.bfloat16, torch.float32):
    torch.manual_seed(0)
    model = type(model).from_config(config).to("cuda", dtype).eval().requires_grad_(False)
    xx, kw = flux_inputs(model, batch=1, side=16, text=8)
    cast = lambda v: v.to("cuda", dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    xx, kw = cast(xx), {k: cast(v) for k, v in kw.items()}

    def call():
        with torch.no_grad():
            return model(xx, **kw, return_dict=False)[0].float()

    stock = call()
    outs = {}
    with sd_kernels.patched(model, precision="fp8", cuda_graph=False):
        for codes in (False, True):
            for hand in (False, True):
                codes_readers.CODES_ONLY, dit_handoff.HAND_ON = codes, hand
                outs[codes, hand] = call()
        again = call()
    base = outs[False, False]
    print(dtype, "tier vs stock", f"{rel_err(base, stock):.2e}", "same call twice", f"{rel_err(again, outs[True, True]):.2e}")
    for k, v in outs.items():
        print(dtype, "codes_only=%s hand_on=%s" % k, f"{rel_err(v, base):.2e}", torch.equal(v, base))
