"""Work sd_kernels does for a call made under ``torch.inference_mode()``, run outside it.

Inference tensors keep no version counter, and a tensor made under inference mode may not be changed in place
outside it. The paths that check tensors by their version counters (FP8 codes and K/V statistics handed between
kernels, the joined modulations, a block's norm handed to the next) serve no inference tensors, and buffers made
under inference mode cannot be written by a later call made outside it. What sd_kernels runs for its own
purposes (a CUDA graph's capture and replays, a step table's fill, the buffers made at a first call or a patch
that later calls write in place: the step table, the VAE decoder's bf16 copy, the ring's exchange) therefore runs
outside inference mode, with autograd off: it only reads the caller's tensors, and what it makes serves calls in
both modes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Inside: inference mode off and autograd off where the caller is under ``torch.inference_mode()``; else
    nothing changes."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) alone would turn autograd on
        yield
