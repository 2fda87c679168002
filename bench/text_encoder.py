"""T5's encoder as the pipelines run it: stock transformers against the patch's kernels (patches/t5_encoder.py).

Each model's T5 (random weights from the shipped config, the pipeline's dtype, its prompt length: FLUX.1-dev
512 tokens in bf16, SD3-medium 256 in fp16, PixArt-Σ 300 in bf16) is timed as one call replayed from a CUDA
graph, as ``cuda_graph="pipeline"`` replays it, stock and patched in one process; ``eager`` is the stock
call launched op by op, as an unpatched pipeline runs it. The error columns compare each output with the
stock encoder run in fp32 on the same weights (relative L2 and max abs), so ours sits beside stock's own
rounding. A step's device time by kernel category comes from one profiled replay.

    python -m bench.text_encoder --out DIR [--models flux-dev,sd3-medium,pixart-sigma]
"""

from __future__ import annotations

import argparse
import copy
import pathlib

import torch

from bench import common
from bench.dit import _kernel_categories
from sd_kernels.models import build_model, load_config
from sd_kernels.testing import rel_err

# (model, T5's part, dtype, tokens)
MODELS = {"flux-dev": ("text_encoder_2", torch.bfloat16, 512), "sd3-medium": ("text_encoder_3", torch.float16, 256),
          "pixart-sigma": ("text_encoder", torch.bfloat16, 300)}
COLUMNS = ["model", "tokens", "dtype", "variant", "ms", "vs_stock", "rel_err", "max_abs_err", "kernels_ms", "device",
           "torch", "triton", "transformers", "date"]


def _patched(encoder):
    """``encoder`` with the patch's T5 forwards (the record that undoes them is returned too)."""
    from sd_kernels.patches import PATCHERS, t5_encoder
    from sd_kernels.patches.record import PatchRecord

    from sd_kernels.profiles import get_profile

    prof = get_profile(None)
    record = PatchRecord(tuple(PATCHERS), prof.name, [], profile_spec=prof)
    t5_encoder.patch_t5(encoder, record)
    return record


def run(model: str, out: pathlib.Path) -> list[dict]:
    import transformers

    part, dtype, tokens = MODELS[model]
    env = common.environment()
    torch.manual_seed(0)
    encoder = build_model(model, part, "cuda", dtype).eval()
    vocab = load_config(model)[part].get("vocab_size", 32128)
    ids = torch.randint(2, vocab, (1, tokens), device="cuda")
    with torch.no_grad():
        reference = copy.deepcopy(encoder).float()(ids)[0]
        call = lambda: encoder(ids)[0]  # noqa: E731
        rows = []
        for variant in ("eager", "stock", "ours"):
            record = _patched(encoder) if variant == "ours" else None
            got = call()
            ms = common.time_ms(call) if variant == "eager" else common.time_graph_ms(call, calls=4, replays=10)
            kernels = _kernel_categories(call if variant == "eager" else common.graphed(call))
            rows.append({"model": model, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                         "variant": variant, "ms": round(ms, 3), "rel_err": f"{rel_err(got, reference):.2e}",
                         "max_abs_err": f"{(got.float() - reference).abs().max().item():.2e}",
                         "kernels_ms": " ".join(f"{c}={v}" for c, v in kernels.items()),
                         "transformers": transformers.__version__,
                         **{k: env.get(k, "") for k in ("device", "torch", "triton", "date")}})
            if record is not None:
                record.undo()
    stock = next(r["ms"] for r in rows if r["variant"] == "stock")
    for r in rows:
        r["vs_stock"] = round(r["ms"] / stock, 3)
    common.append_csv(out / "text_encoder.csv", rows, COLUMNS)
    print(common.format_table(rows, ["model", "tokens", "variant", "ms", "vs_stock", "rel_err", "max_abs_err"]),
          flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        run(model, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
