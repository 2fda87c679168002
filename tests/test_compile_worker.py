"""The precompile's compiler processes (opt-in, SD_KERNELS_COMPILE_PROCESSES=N; compile_pool.py and
compile_worker.py): a package kernel's specialization, as Triton's jit_cache_hook records it at a
launch, compiles in a worker for a Hopper target into the disk cache, and Triton's own
``JITFunction.preload`` of the same data then finds that entry instead of compiling again; a worker
answers an error for what it cannot do and stays up; one that dies is stopped and its kernel left to
the threads. Runs on CPU: Triton compiles for CUDA targets without a driver, and a stand-in driver
lets a launch reach the hook."""

import json
import os
import pathlib
import sys
import textwrap

import cuda_standin
import pytest

from sd_kernels.runtime import compile_pool

HOPPER = ["cuda", 90, 32]
GELU = "sd_kernels.ops.gelu"

# In a process without the interpreter, under a stand-in CUDA driver: (1) a whole precompile (its dry
# run records two launches of the elementwise GELU kernel; its threads and the ready compiler process
# share them), then (2) two more specializations, recorded by the hook as
# a dry run records them, compiled with no thread of the precompile's own: the process compiles both,
# the preloads find them.
SCRIPT = textwrap.dedent("""
    import importlib, json, pathlib, sys
    import torch
    import cuda_standin
    from sd_kernels.runtime import compile_pool, precompile

    cuda_standin.install()
    jit = importlib.import_module("sd_kernels.ops.gelu")._ELEMENTWISE.jit
    x = torch.randn(64, 256).half()
    cubins = lambda: sorted(str(p) for p in pathlib.Path(sys.argv[1]).rglob("*.cubin"))

    def launch(*blocks):
        for block_c in blocks:
            jit[(4,)](x, torch.empty_like(x), 64, 256, 256, 1, 256, GATED=False, ACT="tanh", BLOCK_R=16,
                      BLOCK_C=block_c, num_warps=4)

    precompile.start_workers()  # as a patch does when it installs CUDA graphs
    assert compile_pool.live()[0].poll_ready(300)
    report = precompile.precompile(lambda: launch(256, 128))
    whole = {"compiled": report.compiled, "failed": report.failed, "cubins": len(cubins()),
             "cached": len(jit.device_caches[0][0])}
    with cuda_standin.recording() as recorded:
        launch(64, 32)
    errors, processes = precompile._compile([(jit, data) for data in recorded], 0, None)
    keys = [json.loads(data)["key"] for data in recorded]
    print(json.dumps({"whole": whole, "errors": errors, "processes": processes, "cubins": len(cubins()),
                      "loaded": [k in jit.device_caches[0][0] for k in keys]}))
    compile_pool.shutdown()
""")


@pytest.mark.integration
def test_a_compiler_process_compiles_what_tritons_preload_then_finds(tmp_path):
    result = cuda_standin.run(SCRIPT, str(tmp_path), env={"TRITON_CACHE_DIR": str(tmp_path), compile_pool.ENV: "1"})
    # the whole precompile: both kernels compiled once each (by a thread or the process), both in the cache
    assert result["whole"] == {"compiled": 2, "failed": 0, "cubins": 2, "cached": 2}
    assert result["errors"] == [] and result["processes"] == 1
    assert result["cubins"] == 4  # each specialization compiled once: these two by the worker...
    assert result["loaded"] == [True, True]  # ...and in the kernel cache after the preloads


@pytest.mark.integration
def test_a_worker_answers_what_it_cannot_do_and_is_stopped_when_it_hangs(tmp_path):
    worker = compile_pool.Worker(str(tmp_path))
    try:
        assert worker.poll_ready(300)
        data = json.dumps({"name": f"{GELU}._other_kernel", "signature": {}, "constant_keys": [],
                           "constant_vals": [], "attrs_keys": [], "attrs_vals": [], "options": {}, "key": "k"})
        missing = worker.compile(["sd_kernels.ops.no_such_module", "_kernel", data, HOPPER])
        assert missing.startswith("sd_kernels.ops.no_such_module._kernel: ModuleNotFoundError")
        assert "_other_kernel" in worker.compile([GELU, "_elementwise_kernel", data, HOPPER])  # another kernel's data
        assert "not a Triton kernel" in worker.compile([GELU, "_activation", data, HOPPER])
        assert "JSONDecodeError" in worker.compile([GELU, "_elementwise_kernel", "{not json", HOPPER])
        assert not worker.dead  # errors are answers: the worker stays up
        # importing diffusers' UNet (about 3 s) takes longer than the half second given: no answer in time
        unet = "diffusers.models.unets.unet_2d_condition"
        assert "no answer within" in worker.compile([unet, "_kernel", data, HOPPER], timeout=0.5)
        assert worker.dead and worker.proc.poll() is not None
    finally:
        worker.stop()
    assert list(pathlib.Path(tmp_path).rglob("*.cubin")) == []


def _stand_in(script: str) -> compile_pool.Worker:
    """A Worker driving ``python -c script`` instead of a compiler process."""
    return compile_pool.Worker("unused", command=[sys.executable, "-c", script])


READY = "import sys; print('\"ready\"', flush=True); sys.stdin.readline()"


@pytest.mark.parametrize("script, said", [(READY + "; print('not json', flush=True); sys.stdin.readline()",
                                           "answered 'not json'"),
                                          (READY, "exited with 0")], ids=["nonsense", "dies"])
def test_a_worker_that_answers_nonsense_or_dies_is_stopped(script, said):
    worker = _stand_in(script)
    try:
        assert worker.poll_ready(60)
        assert said in worker.compile([GELU, "_elementwise_kernel", "{}", HOPPER], timeout=60)
        assert worker.dead and worker.proc.poll() is not None
    finally:
        worker.stop()


def test_a_worker_that_ends_before_it_is_ready_is_stopped():
    worker = _stand_in("print('starting')")
    assert not worker.poll_ready(60) and worker.dead


@pytest.mark.parametrize("value, count", [("", 0), ("0", 0), ("1", 1), ("999", min(os.cpu_count() or 1, 16))])
def test_the_environment_asks_for_a_count_of_processes(monkeypatch, value, count):
    monkeypatch.setenv(compile_pool.ENV, value)
    assert compile_pool.requested() == count


def test_a_setting_that_is_not_a_count_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(compile_pool.ENV, "yes")
    with pytest.raises(ValueError, match=compile_pool.ENV):
        compile_pool.requested()
