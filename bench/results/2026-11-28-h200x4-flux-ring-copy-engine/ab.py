"""bench.parallel with one of the ring exchange's choices changed, for an A/B in one run: AB=whole (every
attention waits for every slot: no parts), AB=parts-all (the single-stream blocks' attention in parts too),
AB=prio0 (the exchange's stream at normal priority).
    AB=... torchrun --standalone --nproc_per_node W ab.py ARGS..."""
import os
import runpy
import sys

from sd_kernels.patches import context_parallel, flux_attention, peer_gather

mode = os.environ["AB"]
if mode == "whole":
    whole = context_parallel.attend_gathered
    context_parallel.attend_gathered = lambda q, g, c, in_parts=False: whole(q, g, c, False)
elif mode == "parts-all":
    cls = flux_attention.SDKernelsFluxAttnProcessor
    begin = cls._begin
    cls._begin = lambda self, *a, in_parts=False: begin(self, *a, in_parts=True)
elif mode == "prio0":
    peer_gather.STREAM_PRIORITY = 0
else:
    raise SystemExit(f"AB={mode}?")
sys.argv = ["bench.parallel", *sys.argv[1:]]
sys.path.insert(0, os.getcwd())  # bench/ is a folder of the checkout, not installed
runpy.run_module("bench.parallel", run_name="__main__")
