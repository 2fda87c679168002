"""Compile a Gluon kernel for sm_90 on a machine with no GPU (Triton 3.6): catches errors, dumps ptx/sass."""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource


def compile_sm90(kernel, args: dict, num_warps=4, num_stages=1, maxnreg=None):
    fn = kernel
    params = list(inspect.signature(fn.fn).parameters)
    sig, consts = {}, {}
    for name in params:
        v = args[name]
        kp = [p for p in fn.params if p.name == name][0]
        if kp.is_constexpr:
            sig[name] = "constexpr"
            consts[(params.index(name),)] = v
        else:
            sig[name] = mangle_type(v)
    src = GluonASTSource(fn, sig, consts)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
