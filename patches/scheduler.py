"""Scheduler timesteps on the host: a denoising loop in which the host never waits for the GPU.

diffusers' pipelines put the scheduler's timesteps on the GPU (``set_timesteps(n, device=...)``),
and then each step of PNDM (SD1.x's default) and DDIM indexes the scheduler's host tables with that
GPU timestep and branches on ``prev_timestep >= 0``: two device-to-host reads, so the host waits for
the GPU to finish the UNet before it can queue the next step. With the UNet replayed from a CUDA
graph the step's launches cost little host time, but the wait makes the GPU idle while the host runs
the pipeline's Python between steps (measured in docs/results.md).

With the timesteps on the host, the schedulers' arithmetic on them (table look-ups, ``sigma``
arithmetic, step-index searches) is host arithmetic, and reaches the GPU only as kernel scalar
arguments; the UNet's timestep reaches it through the graphs' asynchronous copy-in
(patches/cuda_graph.py). The pipeline's images are unchanged: the timesteps' values are the same.

Applied by ``patch(pipe, cuda_graph=True)`` to the pipeline's scheduler when its class is one of
``HOST_SCHEDULERS`` (checked on the GPU: same images, no sync inside the loop; UniPC's own step still
copies its sigmas to the GPU one by one, so it keeps some waits). ``set_timesteps`` becomes an
instance attribute that calls the class's method with ``device="cpu"``; unpatch removes it. A
scheduler swapped in after the patch runs as diffusers ships it until the pipeline is patched again.
"""

from __future__ import annotations

import functools
import inspect

from .record import PatchRecord

HOST_SCHEDULERS = ("PNDMScheduler", "DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
                   "DPMSolverMultistepScheduler", "UniPCMultistepScheduler")


def host_timesteps(scheduler: object, record: PatchRecord) -> bool:
    """Make ``scheduler.set_timesteps`` keep its timesteps on the host; False if its class is not one
    of HOST_SCHEDULERS (then it is left alone, and noted in the record)."""
    name = type(scheduler).__name__
    if name not in HOST_SCHEDULERS:
        record.skip("scheduler", name, "timesteps stay where the pipeline puts them (a scheduler not checked "
                    f"with host timesteps: {', '.join(HOST_SCHEDULERS)})")
        return False
    method = scheduler.set_timesteps
    signature = inspect.signature(method)
    if "device" not in signature.parameters:
        record.skip("scheduler", name, "its set_timesteps takes no device")
        return False

    @functools.wraps(method)  # inspect.signature (diffusers' retrieve_timesteps reads it) sees the original
    def set_timesteps(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["device"] = "cpu"
        return method(*bound.args, **bound.kwargs)

    record.set_attr(scheduler, "set_timesteps", set_timesteps, "host_timesteps")
    return True
