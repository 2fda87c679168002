"""The FP8 tier's modulations of every step made before a call's first step and served from a table
(patches/modulation_table.py): the denoising loops of FluxPipeline and StableDiffusion3Pipeline re-stated over the
tiny transformers (the pipelines' own arithmetic on the timestep), their outputs bit for bit those of the tier
without the table. The tier alone (``ops=[]``): the table serves the tier's modulation GEMM, and the other
families' kernels would only run beside it through the interpreter."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from dit_checks import cpu_only
from sd_kernels.patches import modulation_table
from test_flux_patch import _inputs as flux_inputs
from test_fp8_patch import _model
from test_sd3_patch import _inputs as sd3_inputs

import sd_kernels

STEPS = 2


def _inputs(name, model, seed=0):
    x, kw = flux_inputs(model, batch=1, side=4, text=4, seed=seed) if name == "tiny-flux" else sd3_inputs(
        model, batch=2, side=8, seed=seed)
    half = lambda v: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    kw = {k: half(v) for k, v in kw.items() if k != "timestep"}
    if "guidance" in kw:
        kw["guidance"] = kw["guidance"].float()  # FluxPipeline's guidance is float32
    return x.half(), kw


def _loop(name, model, scheduler, x, kw):
    """The pipelines' loop body: FLUX passes ``t.expand(B).to(latents.dtype) / 1000``, SD3 ``t.expand(B)``."""
    scheduler.set_timesteps(STEPS)
    outputs = []
    with torch.no_grad():
        for t in scheduler.timesteps:
            timestep = t.expand(x.shape[0]).to(x.dtype) / 1000 if name == "tiny-flux" else t.expand(x.shape[0])
            out = model(hidden_states=x, timestep=timestep, **kw, return_dict=False)[0]
            outputs.append(out)
            x = scheduler.step(out, t, x, return_dict=False)[0]
    return torch.stack(outputs)


def _groups(model):
    return list({id(m.modulations): m.modulations for m in model.modules()
                 if getattr(m, "modulations", None) is not None}.values())


def _install(model, record, scheduler):
    """The pre-hook, as ``patch(pipe, precision="fp8")`` installs it, for a stand-in pipeline of ``scheduler``."""
    record.target = lambda: SimpleNamespace(scheduler=scheduler)
    groups = _groups(model)
    return modulation_table.install(model, groups, record), groups


@pytest.mark.integration
@cpu_only
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
def test_every_step_is_served_and_the_outputs_are_the_tiers_without_the_table(name):
    model = _model(name)
    x, kw = _inputs(name, model)
    scheduler = FlowMatchEulerDiscreteScheduler()
    with sd_kernels.patched(model, precision="fp8", ops=[], cuda_graph=False) as record:
        tables, groups = _install(model, record, scheduler)
        assert tables is not None and len(groups) == 1
        served = _loop(name, model, scheduler, x, kw)
        table = groups[0].table
        assert table.nbytes == modulation_table.table_bytes(groups[0])
        assert tables.fills == 1 and table.served.item() == STEPS - 1  # filled after the first step
        assert table.valid.sum().item() == STEPS * x.shape[0]
        other = _inputs(name, model, seed=1)[1]  # another prompt: a second fill, after the first's rows
        served_other = _loop(name, model, scheduler, x, other)
        assert tables.fills == 2 and table.served.item() == 2 * (STEPS - 1)
        assert table.valid.sum().item() == 2 * STEPS * x.shape[0]
        again = _loop(name, model, scheduler, x, kw)  # the first prompt again: its first step too
        assert table.served.item() == 2 * (STEPS - 1) + STEPS
    assert groups[0].table is None  # unpatch dropped it
    with sd_kernels.patched(model, precision="fp8", ops=[], cuda_graph=False):
        assert not _groups(model)[0].table
        own = _loop(name, model, scheduler, x, kw)
        own_other = _loop(name, model, scheduler, x, other)
    assert torch.equal(served, own) and torch.equal(served_other, own_other) and torch.equal(again, own)


@pytest.mark.integration
@cpu_only
def test_a_call_under_inference_mode_fills_the_table_as_one_outside_it():
    """Where the transformer's calls replay CUDA graphs (which run outside inference mode: patches/cuda_graph.py),
    a call made under inference mode fills the table outside it (patches/modes.py): the same rows, keys and products
    bit for bit, in a table a later call outside inference mode still writes. An eager call under inference mode,
    which takes no table (fp8_modulations: no version counters), makes none."""
    name = "tiny-flux"
    model = _model(name)
    x, kw = _inputs(name, model)

    class Graphed:  # stands in for cuda_graph.GraphedCall, which the fill knows by this attribute
        replays_outside_inference_mode = True

        def __init__(self, forward):
            self.forward = forward

        def __call__(self, *args, **kwargs):
            return self.forward(*args, **kwargs)

    tables_seen = {}
    for inference, graphed in ((False, False), (True, False), (True, True)):
        with sd_kernels.patched(model, precision="fp8", ops=[], cuda_graph=False) as record:
            scheduler = FlowMatchEulerDiscreteScheduler()
            tables, groups = _install(model, record, scheduler)
            if graphed:
                model.forward = Graphed(model.forward)
            try:
                with torch.inference_mode(inference):
                    _loop(name, model, scheduler, x, kw)
            finally:
                if graphed:
                    del model.forward
            table = groups[0].table
            assert tables.fills == (0 if inference and not graphed else 1)
            if tables.fills:
                assert not table.values.is_inference()
                tables_seen[inference] = (table.keys.clone(), table.values.clone(), table.valid.clone())
                _loop(name, model, scheduler, x, _inputs(name, model, seed=1)[1])  # outside it: a second fill
                assert tables.fills == 2
    for a, b in zip(tables_seen[False], tables_seen[True], strict=True):
        assert torch.equal(a, b)


@pytest.mark.integration
@cpu_only
def test_a_timestep_the_fill_did_not_see_is_computed_and_a_changed_bias_or_weight_clears_the_table():
    name = "tiny-flux"
    model = _model(name)
    x, kw = _inputs(name, model)
    scheduler = FlowMatchEulerDiscreteScheduler()
    strange = {**kw, "hidden_states": x, "timestep": torch.full((1,), 0.123, dtype=x.dtype), "return_dict": False}
    with sd_kernels.patched(model, precision="fp8", ops=[], cuda_graph=False) as record, torch.no_grad():
        tables, (group,) = _install(model, record, scheduler)
        _loop(name, model, scheduler, x, kw)
        assert group.table.served.item() == STEPS - 1
        computed = model(**strange)[0]
        assert group.table.served.item() == STEPS - 1
        group.table.clear()
        assert torch.equal(computed, model(**strange)[0])
        _loop(name, model, scheduler, x, kw)
        assert group.table.served.item() == 2 * (STEPS - 1) and group.table_states is not None
        group.layers[0].bias.add_(1)  # in place, in the laid-out buffer the GEMM reads: the rows are stale
        scheduler._step_index = 1  # past the first step: no fill
        model(**{**strange, "timestep": scheduler.timesteps[1].expand(1).to(x.dtype) / 1000})
        assert group.table_states is None and group.table.valid.sum().item() == 0
        assert group.table.served.item() == 2 * (STEPS - 1)
        _loop(name, model, scheduler, x, kw)  # filled again with the new bias
        assert group.table.served.item() == 3 * (STEPS - 1) and group.table_states is not None
        group.layers[0].weight.mul_(2)  # in place: the table's rows are stale (the layer's codes are made again)
        scheduler.set_timesteps(STEPS)
        scheduler._step_index = 1  # past the first step: no fill
        model(**{**strange, "timestep": scheduler.timesteps[1].expand(1).to(x.dtype) / 1000})
        assert group.table_states is None and group.table.valid.sum().item() == 0
        _loop(name, model, scheduler, x, kw)  # the layer has codes of its own now: no joined GEMM, no fill
        assert group.table.served.item() == 3 * (STEPS - 1) and group.table_states is None


@cpu_only
def test_what_installs_no_table(monkeypatch):
    """A bare model (no scheduler to read), a compiling patch, the switch off, a class with no step embedding
    here."""
    model = _model("tiny-flux")
    with sd_kernels.patched(model, precision="fp8", ops=[], cuda_graph=False) as record:
        groups = _groups(model)
        assert modulation_table.install(model, groups, record) is None
        assert "served from a table" not in record.format()
        record.target = lambda: SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler())
        record.compile = "default"
        assert modulation_table.install(model, groups, record) is None  # compiled calls take no table
        record.compile = None
        monkeypatch.setattr(modulation_table, "STEP_TABLE", False)
        assert modulation_table.install(model, groups, record) is None
        monkeypatch.setattr(modulation_table, "STEP_TABLE", True)
        monkeypatch.delitem(modulation_table.EMBEDDINGS, "FluxTransformer2DModel")
        assert modulation_table.install(model, groups, record) is None


@pytest.mark.gpu
@pytest.mark.parametrize("inference", [False, True])
def test_gpu_flux_pipeline_graphs_serve_every_step_and_make_the_tiers_image(monkeypatch, inference):
    """FluxPipeline patched with the tier (its transformer replayed from CUDA graphs): once captured, a call of a
    prompt seen before serves all of its steps from the table, and every image is the one the tier makes without
    the table, bit for bit; under ``torch.inference_mode()`` as well (the fill and the replays run outside it)."""
    from sd_kernels import models

    pipe = models.build_pipeline("tiny-flux", device="cuda", dtype=torch.bfloat16)
    kw = dict(prompt="a red cube", num_inference_steps=4, height=128, width=128, output_type="latent")
    latents, served = {}, []
    for table in (True, False):
        monkeypatch.setattr(modulation_table, "STEP_TABLE", table)
        with sd_kernels.patched(pipe, precision="fp8") as record:
            assert ("served from a table of 64 rows (" in record.format()) == table
            with torch.inference_mode(inference):
                latents[table] = [pipe(**kw, generator=torch.Generator("cuda").manual_seed(0)).images
                                  for _ in range(3)]
                if table:
                    group, = _groups(pipe.transformer)
                    served.append(group.table.served.item())
                    pipe(**kw, generator=torch.Generator("cuda").manual_seed(0))
                    served.append(group.table.served.item())
    assert served[1] - served[0] == kw["num_inference_steps"]
    for a, b in zip(latents[True], latents[False], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(latents[True][0], latents[True][2])
