"""patches/scheduler.py: UniPC's step coefficients on the host (HostScalars), on CPU with the meta
device standing in for the GPU; the GPU test checks the images and that the loop never waits."""

from __future__ import annotations

import pytest
import torch
from sd_kernels.patches import diffusers_sources as verified
from sd_kernels.patches import scheduler as sched
from sd_kernels.patches.record import PatchRecord
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")


def _record():
    return PatchRecord((), "test", [], "pipeline", False)


def test_host_scalars_keeps_small_tensors_on_the_host():
    with sched.HostScalars(META):
        assert torch.ones((), device=META).device.type == "cpu"
        assert torch.tensor([1.0, 2.0], device="meta").device.type == "cpu"
        assert torch.zeros(sched.HOST_NUMEL + 1, device=META).device == META  # a latent-sized tensor goes
        assert torch.ones(3).to(META).device.type == "cpu"
        assert torch.ones(3).to(META, torch.float16).dtype == torch.float16
        assert torch.ones(sched.HOST_NUMEL + 1).to(META).device == META
        assert torch.ones(3).to(device="meta").device.type == "cpu"
        big = torch.zeros(2, 3, 5, device=META)
        with _DeviceOps() as ops:
            mixed = torch.einsum("k,bkc->bc", torch.ones(3), big)  # a host vector meets a device tensor: copied
            assert (torch.ones(()) * big).device == META  # 0-d: a scalar to the kernel, no copy
        assert mixed.device == META and mixed.shape == (2, 5) and ops.copies == 1
        host = torch.zeros(3)
        host.add_(torch.ones(3))  # in place: left as it is
        assert host.tolist() == [1.0, 1.0, 1.0]
    assert torch.ones((), device=META).device == META  # outside the mode nothing changes


class _DeviceOps(TorchDispatchMode):
    """Counts the computing ops (not views) whose output is a small tensor on the meta device:
    coefficient arithmetic there (``math``), and copies of small tensors to it (``copies``)."""

    def __init__(self):
        super().__init__()
        self.math = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        small = isinstance(out, torch.Tensor) and out.device == META and out.numel() <= sched.HOST_NUMEL
        if small and not func.is_view:
            if func is torch.ops.aten._to_copy.default:
                self.copies += 1
            else:
                self.math += 1
        return out


def _unipc_run(patched: bool, steps: int = 6) -> _DeviceOps:
    import diffusers

    s = diffusers.UniPCMultistepScheduler(num_train_timesteps=1000)
    s.set_timesteps(steps, device="cpu")  # the pipeline mode's host timesteps
    record = _record()
    if patched:
        assert sched.host_scalars(s, record)
        assert record.counts["host_scalars"] == 2
    x = torch.zeros(1, 4, 8, 8, device=META)
    with _DeviceOps() as count:
        for t in s.timesteps:
            x = s.step(torch.zeros(1, 4, 8, 8, device=META), t, x).prev_sample
    assert x.device == META and x.shape == (1, 4, 8, 8)
    record.undo()
    assert not any(n in vars(s) for n in sched.HOST_SCALAR_METHODS["UniPCMultistepScheduler"])
    return count


def test_unipc_coefficients_leave_the_device():
    """As diffusers ships it, UniPC computes each step's coefficients as small tensors on the samples'
    device (on a GPU: blocking copies and a checked solve every step); patched, none is computed
    there, and what reaches it is the one coefficient vector per predictor or corrector einsum."""
    stock, ours = _unipc_run(patched=False), _unipc_run(patched=True)
    assert stock.math > 100 and stock.copies > 20
    assert ours.math == 0 and 0 < ours.copies <= 2 * 6


def test_a_copied_scheduler_runs_its_own_state():
    """The patch's methods are bound to the scheduler: copy.deepcopy binds the copy's to the copy."""
    import copy

    import diffusers

    s = diffusers.UniPCMultistepScheduler(num_train_timesteps=1000)
    record = _record()
    assert sched.host_timesteps(s, record) and record.counts["host_scalars"] == 2
    twin = copy.deepcopy(s)
    twin.set_timesteps(4, device="meta")
    assert twin.timesteps.device.type == "cpu" and s.num_inference_steps is None  # the copy's own, on the host
    x = torch.zeros(1, 4, 8, 8, device=META)
    for t in twin.timesteps:
        x = twin.step(torch.zeros(1, 4, 8, 8, device=META), t, x).prev_sample
    assert twin.step_index == 4 and s.step_index is None


def test_other_diffusers_code_is_left_alone(monkeypatch):
    import diffusers

    monkeypatch.setitem(verified.VERIFIED, "UniPCMultistepScheduler.multistep_uni_c_bh_update", "0" * 16)
    verified.is_verified.cache_clear()
    try:
        s = diffusers.UniPCMultistepScheduler()
        record = _record()
        assert not sched.host_scalars(s, record)
        assert "multistep_uni_p_bh_update" not in vars(s)
        assert any("coefficients stay on the GPU" in k.reason for k in record.skipped)
    finally:
        monkeypatch.undo()
        verified.is_verified.cache_clear()


def test_only_unipc_has_host_scalar_methods():
    import diffusers

    assert not sched.host_scalars(diffusers.DDIMScheduler(), _record())


@pytest.mark.gpu
# solver_type="bh1", lower_order_final=False and predict_x0=False are left out: with random model
# outputs diffusers' own 20 steps end in NaN or inf in every dtype, float64 included, on the CPU and on
# the H100 (measured 2026-11-24, bench/results/2026-11-24-h100-streamed-decode), so there is nothing to compare.
@pytest.mark.parametrize("config", [{}, {"solver_order": 3}], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_unipc_on_host_scalars_matches_and_never_waits(dtype, config):
    """20 UniPC steps on CUDA latents with random model outputs: patched (the coefficients computed
    in float32 on the host instead of the GPU) against diffusers' own, both against the same steps
    in float64: ours within 2× stock's error (plus fp32's own rounding); and no host sync."""
    import diffusers

    def run(patched, sync_mode="default", run_dtype=dtype):  # inputs rounded to dtype whatever run_dtype
        s = diffusers.UniPCMultistepScheduler(num_train_timesteps=1000, **config)
        s.set_timesteps(20, device="cpu")
        if patched:
            sched.host_scalars(s, _record())
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(2, 4, 64, 64, device="cuda", generator=g).to(dtype).to(run_dtype)
        outs = [torch.randn(2, 4, 64, 64, device="cuda", generator=g).to(dtype).to(run_dtype) for _ in s.timesteps]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            for t, eps in zip(s.timesteps, outs):
                x = s.step(eps, t, x).prev_sample
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return x.double()

    exact, stock, got = run(False, run_dtype=torch.float64), run(False), run(True, "error")  # "error": a sync raises
    assert torch.isfinite(exact).all() and torch.isfinite(stock).all()
    scale = exact.abs().max().item()
    stock_err, err = ((t - exact).abs().max().item() / scale for t in (stock, got))
    assert err <= 2 * stock_err + 1e-6, f"ours {err:.2e}, stock {stock_err:.2e} of the largest value"
