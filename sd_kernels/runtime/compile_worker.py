"""A compiler process for the parallel precompile: ``python -m sd_kernels.runtime.compile_worker``.

Triton compiles a kernel mostly while holding the interpreter's lock (its Python front end and the MLIR
passes), so the precompile's threads overlap little more than ptxas: 52 kernels took 7.5-10 s on 16
threads (SD1.5 at 512², H200). A process of its own compiles truly in parallel, into Triton's disk
cache; the caller then loads each kernel from there (compile_pool.py; opt-in:
``SD_KERNELS_COMPILE_PROCESSES``).

Protocol, one JSON line each way: the worker imports the modules named on its command line (the
kernels' package, which sits above this layer: named, not imported here), then writes ``"ready"``;
then, per line on stdin, ``[module, kernel name, specialization data, [backend, arch, warp size]]``
(the data ``knobs.runtime.jit_cache_hook`` serializes, the same that ``JITFunction.preload`` takes),
it compiles and answers ``{"ok": true}`` or ``{"error": "..."}``; it exits at the end of stdin. Its
own stdout is stderr: nothing an import prints can break a line. It never touches a GPU (the caller
hides them: CUDA_VISIBLE_DEVICES is empty).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def find_jit(module: str, name: str) -> Any:
    """The JITFunction a module defines under ``name`` (under its autotuner or heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    obj = getattr(importlib.import_module(module), name)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module}.{name} is not a Triton kernel")
    return obj


def _tuples(value: Any) -> Any:
    """JSON's lists back to the tuples Triton serialized (lists are not kernel arguments)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _constant(value: Any) -> Any:
    import triton.language as tl

    if tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(_tuples(value["constexpr"]))
    if isinstance(value, dict) and "jit_function" in value:  # a kernel passed as a constexpr: "module:name"
        return find_jit(*value["jit_function"].split(":", 1))
    if isinstance(value, dict):
        raise ValueError(f"a constant this worker cannot rebuild: {value}")
    return _tuples(value)


def compile_one(jit: Any, data: str, target: Any) -> Any:
    """Compile ``jit`` for the specialization ``data`` describes, as ``JITFunction.preload`` would
    (the same source, constants, attributes and options: the same disk-cache entry)."""
    import triton
    from triton.compiler.compiler import ASTSource

    spec = json.loads(data)
    if spec["name"] not in (getattr(jit, "_fn_name", None), f"{jit.fn.__module__}.{jit.fn.__qualname__}",
                            jit.fn.__name__):  # Triton 3.6 writes module.qualname
        raise ValueError(f"specialization data of {spec['name']} for {jit.fn.__name__}")
    constexprs = {tuple(k): _constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in spec["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    return triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options)


def answer(line: str) -> dict[str, Any]:
    """The answer to one request line."""
    from triton.backends.compiler import GPUTarget

    what = "a request"
    try:
        module, name, data, target = json.loads(line)
        what = f"{module}.{name}"
        compile_one(find_jit(module, name), data, GPUTarget(*target))
        return {"ok": True}
    except Exception as exc:  # the caller compiles it and reports what is wrong
        return {"error": f"{what}: {type(exc).__name__}: {str(exc)[:500]}"}


def main() -> int:
    out = os.fdopen(os.dup(1), "w")  # the protocol's channel; anything else printed goes to stderr
    os.dup2(2, 1)
    if hasattr(os, "nice"):
        os.nice(10)  # below the process that started it: a core it needs is never taken
    for module in sys.argv[1:]:  # before saying ready: the first job pays no import
        importlib.import_module(module)

    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(answer(line)) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
