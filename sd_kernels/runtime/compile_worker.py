"""A compiler process for the parallel precompile: ``python -m sd_kernels.runtime.compile_worker``.

Triton compiles a kernel mostly while holding the interpreter's lock (its Python front end and the MLIR
passes), so the precompile's threads overlap little more than ptxas: 52 kernels took 7.5-10 s on 16
threads (SD1.5 at 512², H200). A process of its own per share of the kernels compiles them truly in
parallel into Triton's disk cache; the caller's threads then load each from there (opt-in:
``SD_KERNELS_COMPILE_PROCESSES=1``, see precompile.py).

Reads one JSON object on stdin: ``{"target": [backend, arch, warp_size], "jobs": [[module, name,
specialization data], ...]}`` (the data ``knobs.runtime.jit_cache_hook`` serializes, the same that
``JITFunction.preload`` takes); writes one JSON line: ``{"compiled": n, "errors": [...]}``. It never
touches a GPU (the caller hides them: CUDA_VISIBLE_DEVICES is empty), and a job it cannot do is only
reported: the caller compiles that kernel itself.
"""

from __future__ import annotations

import importlib
import json
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


def main() -> int:
    from triton.backends.compiler import GPUTarget

    request = json.load(sys.stdin)
    target = GPUTarget(*request["target"])
    compiled, errors = 0, []
    for module, name, data in request["jobs"]:
        try:
            compile_one(find_jit(module, name), data, target)
            compiled += 1
        except Exception as exc:  # the caller compiles it and reports what is wrong
            errors.append(f"{module}.{name}: {type(exc).__name__}: {exc}")
    print(json.dumps({"compiled": compiled, "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
