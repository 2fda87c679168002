"""Run bench.fp8's e2e rows with every CUDA-graph reset and eager call counted: does any call of the FP8
tier drop its graphs (a buffer or Parameter set anew, a diffusers hook registered)?"""
import collections
import logging
import sys

from sd_kernels.patches import cuda_graph as cg

resets = collections.Counter()
eager = collections.Counter()
_reset, _eager = cg.GraphedCall.reset, cg.GraphedCall._eager


def reset(self):
    resets[self.label] += 1
    return _reset(self)


def eager_call(self, reason, args, kwargs, level=logging.WARNING):
    eager[(self.label, reason[:90])] += 1
    return _eager(self, reason, args, kwargs, level)


cg.GraphedCall.reset = reset
cg.GraphedCall._eager = eager_call
from bench import fp8  # noqa: E402

rc = fp8.main(sys.argv[1:])
print("graph resets:", dict(resets))
print("eager calls:", {f"{k[0]}: {k[1]}": v for k, v in eager.items()})
sys.exit(rc)
