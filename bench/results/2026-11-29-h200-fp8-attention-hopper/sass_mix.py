"""The FP8 Hopper attention kernel compiled for sm_90a without a GPU, and the instruction mix of its main
loop, from the SASS (what README.md's instruction counts come from).

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0 numpy
    /tmp/t36/bin/python bench/results/2026-11-29-h200-fp8-attention-hopper/sass_mix.py [OPS_DIR]

Triton 3.6 (the Gluon API the kernel is written against) compiles through ptxas, which needs no GPU: the
tests' stand-in driver (tests/cuda_standin.py) names the target. OPS_DIR (default: this checkout's
sd_kernels/ops) is where the kernel's module is read from, so that a patched copy can be compared. For
each configuration (FLUX's head dim 128 with two consumers, SD3's 64 with three; int8 and e4m3 Q·Kᵀ; 128
and 256 keys a step) it prints ptxas's register and spill figures and its performance advisories, and
the counts of each opcode in the consumer's loop: the backward branch whose body holds 8-bit wgmmas (both
branches of the ragged-block test are in it) with the fewest instructions."""
import collections
import importlib
import pathlib
import re
import subprocess
import sys
import tempfile
import types

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[3]
OPS = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "sd_kernels" / "ops"
BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _kernel_module():
    sys.path.insert(0, str(ROOT))
    pkg = types.ModuleType("ops_under_test")
    pkg.__path__ = [str(OPS)]
    sys.modules["ops_under_test"] = pkg
    return importlib.import_module("ops_under_test.attention_fp8_wgmma_kernel")


def compile_kernel(m, d, nc, int8, block_n, stages):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, s = 1, 24, 4608
    q = torch.empty(b, h, s, d, dtype=torch.bfloat16)
    block = [1, 64, 1, d]
    qd = TensorDescriptor(q, [b, s, h, d], [q.stride(0), q.stride(2), q.stride(1), 1], block,
                          gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    kind, tkind = (gl.int8, torch.int8) if int8 else (gl.float8e4nv, torch.float8_e4m3fn)
    k8 = torch.empty(b * h, s, d, dtype=tkind)
    v8 = torch.empty(b * h, d, s, dtype=torch.float8_e4m3fn)
    kd = TensorDescriptor(k8, list(k8.shape), list(k8.stride()), [1, block_n, d],
                          gl.NVMMASharedLayout.get_default_for([1, block_n, d], kind))
    vd = TensorDescriptor(v8, list(v8.shape), list(v8.stride()), [1, d, block_n],
                          gl.NVMMASharedLayout.get_default_for([1, d, block_n], gl.float8e4nv))
    maxnreg, regs = {2: (168, 240), 3: (128, 160)}[nc]
    return m._attn_fp8_wgmma_fwd.warmup(qd, kd, vd, qd, torch.empty(b * h, s // block_n), torch.empty(b * h, d), h,
                                        s, s // block_n, 0.1, NS=stages, QK_INT8=int8, NC=nc, CONSUMER_REGS=regs,
                                        PINGPONG=True, num_warps=4, maxnreg=maxnreg, grid=(1,))


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    ins = [(int(a, 16), op, line) for line in sass.splitlines()
           if (mm := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line))
           for a, op in [mm.groups()]]
    loops = []
    for addr, op, line in ins:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            if sum(o in ("QGMMA", "IGMMA") for o in body) >= 8:
                loops.append(body)
    body = min(loops, key=len, default=[])  # the innermost: one consumer's key loop
    return len(body), collections.Counter(body)


def main():
    sys.path.insert(0, str(ROOT / "tests"))
    import cuda_standin

    cuda_standin.install()  # an sm_90 target for Triton's JIT on a machine without a GPU
    m = _kernel_module()
    for d, nc, int8, block_n, stages in [(128, 2, True, 128, 3), (128, 2, False, 128, 3), (64, 3, True, 128, 3),
                                         (64, 3, False, 128, 3), (128, 2, False, 256, 2)]:
        name = f"D={d} consumers={nc} qk={'int8' if int8 else 'e4m3'} keys/step={block_n} stages={stages}"
        try:
            k = compile_kernel(m, d, nc, int8, block_n, stages)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name}: does not compile: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = pathlib.Path(tmp, "k.ptx"), pathlib.Path(tmp, "k.cubin")
            ptx.write_text(k.asm["ptx"])
            cubin.write_bytes(k.asm["cubin"])
            ptxas = subprocess.run([BIN / "ptxas", "--gpu-name", "sm_90a", "-v", ptx, "-o", "/dev/null"],
                                   capture_output=True, text=True).stderr
            sass = subprocess.run([BIN / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True).stdout
        notes = [line.split(": ", 1)[-1] for line in ptxas.splitlines()
                 if "Used" in line or "spill" in line or "Performance" in line]
        n, mix = loop_mix(sass)
        print(f"{name}: shared memory {k.metadata.shared} B; " + "; ".join(x.strip() for x in notes))
        print(f"    loop: {n} instructions: " + ", ".join(f"{op} {c}" for op, c in mix.most_common(24)))


if __name__ == "__main__":
    main()
