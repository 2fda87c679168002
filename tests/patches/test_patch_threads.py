"""Patching and unpatching a pipeline that another thread is calling (patches/call_gate.py): every call
runs entirely stock or entirely patched, ``patch`` waits for calls in flight and holds new ones off,
and a patch from inside a call on the same thread is refused."""

import threading
import time

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from sd_kernels.patches import patch_record, registry
from test_patch_core import Doubled  # a stand-in model of an unsupported class

import sd_kernels
from sd_kernels import models


def _doubled(model, record):
    """A stand-in patch whose effect shows in the output: the UNet's (or decoder's) output conv doubled."""
    owner = model if hasattr(model, "conv_out") else model.decoder
    record.set_attr(owner, "conv_out", Doubled(owner.conv_out), "doubled")


@pytest.fixture
def pipe():
    p = models.build_pipeline("tiny")
    p.set_progress_bar_config(disable=True)
    return p


def _image(pipe, **kwargs):
    return pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0), **kwargs).images


def _unet_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 4, 8, 8, generator=g), 10, torch.randn(1, 77, 32, generator=g)


def _unet(pipe):
    x, t, ctx = _unet_inputs()
    return pipe.unet(x, t, encoder_hidden_states=ctx).sample


def _loop(call, stock, stop, outcomes):
    """Call again and again until ``stop``; each result compared with the stock one."""
    while not stop.is_set():
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001 (an error is an outcome the test reports)
            outcomes.append(repr(exc))
        else:
            outcomes.append(float(np.abs(np.asarray(out) - stock).max()))


@pytest.mark.parametrize("call, seconds", [(_image, 3.0), (_unet, 2.0)], ids=["pipeline", "unet"])
def test_calls_on_another_thread_while_patching_give_the_stock_result(pipe, call, seconds, monkeypatch):
    """With the reference backend a patched pipeline computes exactly what stock does, so any
    difference is a call that ran on a half-applied patch (a fused GroupNorm+SiLU before its SiLU
    was made an Identity: SiLU twice)."""
    monkeypatch.setenv("SD_KERNELS_BACKEND", "reference")
    with torch.no_grad():
        stock = np.asarray(call(pipe))
        stop, outcomes = threading.Event(), []
        caller = threading.Thread(target=_loop, args=(lambda: call(pipe), stock, stop, outcomes))
        caller.start()
        cycles, start = 0, time.monotonic()
        try:  # at least ``seconds``, and until the caller has finished two calls during the cycling
            while time.monotonic() < start + seconds or (len(outcomes) < 2 and time.monotonic() < start + 60):
                # a pause after each change, as between a user's: back to back, a held-off call seldom takes the
                # interpreter lock before the next change holds it off again (one call in 60 s on two cores); after
                # both, so that calls run patched as well as stock
                sd_kernels.patch(pipe)
                time.sleep(0.005)
                sd_kernels.unpatch(pipe)
                time.sleep(0.005)
                cycles += 1
        finally:
            stop.set()
            caller.join()
    assert cycles > 1 and len(outcomes) > 1
    assert outcomes == [0.0] * len(outcomes)


def _blocking_callback(entered, release):
    def callback(pipe, i, t, kwargs):
        entered.set()
        assert release.wait(30)
        return kwargs

    return callback


def _thread(target, *args, **kwargs):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", target(*args, **kwargs)))
    thread.start()
    return thread, result


def test_patch_waits_for_a_call_in_flight_which_runs_stock(pipe, monkeypatch):
    monkeypatch.setitem(registry.PATCHERS, "doubled", _doubled)
    stock = _image(pipe)
    entered, release = threading.Event(), threading.Event()
    caller, image = _thread(_image, pipe, callback_on_step_end=_blocking_callback(entered, release))
    assert entered.wait(30)  # the call is inside its denoising loop
    patcher, record = _thread(sd_kernels.patch, pipe, None, ["doubled"])
    time.sleep(0.3)
    assert patcher.is_alive() and patch_record(pipe) is None and type(pipe.unet.conv_out) is not Doubled
    release.set()
    caller.join(30)
    patcher.join(30)
    assert np.array_equal(image["value"], stock)  # the call ran stock from start to end
    assert patch_record(pipe) is record["value"] and type(pipe.unet.conv_out) is Doubled
    assert type(pipe) is StableDiffusionPipeline and type(pipe.unet) is UNet2DConditionModel  # no gate left
    sd_kernels.unpatch(pipe)


@pytest.mark.parametrize("which", ["pipeline", "unet"])
def test_a_call_started_during_a_patch_waits_and_runs_patched(pipe, which, monkeypatch):
    started, release = threading.Event(), threading.Event()

    def slow(model, record):  # a patch that takes its time between two of its changes
        _doubled(model, record)
        started.set()
        assert release.wait(30)

    monkeypatch.setitem(registry.PATCHERS, "doubled", _doubled)
    call = _image if which == "pipeline" else _unet
    with torch.no_grad():
        with sd_kernels.patched(pipe, ops=["doubled"]):
            want = call(pipe)
        stock = call(pipe)
        monkeypatch.setitem(registry.PATCHERS, "slow", slow)
        patcher, _ = _thread(sd_kernels.patch, pipe, None, ["slow"])
        assert started.wait(30)  # the UNet is patched, the VAE not yet
        caller, out = _thread(call, pipe)
        time.sleep(0.3)
        assert caller.is_alive()  # held off until the patch is done
        release.set()
        patcher.join(30)
        caller.join(30)
    assert np.array_equal(np.asarray(out["value"]), np.asarray(want))
    assert not np.array_equal(np.asarray(want), np.asarray(stock))
    sd_kernels.unpatch(pipe)
    assert type(pipe) is StableDiffusionPipeline and type(pipe.unet) is UNet2DConditionModel


def test_patching_from_inside_a_call_on_the_same_thread_is_refused(pipe):
    def callback(p, i, t, kwargs):
        sd_kernels.patch(p)
        return kwargs

    with pytest.raises(RuntimeError, match=r"sd_kernels.patch: called inside a call of this StableDiffusionPipeline"):
        _image(pipe, callback_on_step_end=callback)
    assert patch_record(pipe) is None
    assert type(pipe) is StableDiffusionPipeline and type(pipe.unet) is UNet2DConditionModel
