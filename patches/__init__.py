"""The drop-in patch for diffusers pipelines: ``patch``, ``unpatch``, ``patched``.

``patch(obj)`` takes a diffusers pipeline or a bare UNet2DConditionModel / AutoencoderKL and routes
the parts it knows (PARTS) through sd_kernels' ops. It is idempotent and exactly reversible: the
record of every change hangs on the patched object, and ``unpatch`` restores the original modules
and processors, so outputs are bit-identical to a never-patched model. Parameters are never copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch.nn as nn

from sd_kernels.profiles import set_profile

from . import attention, gelu, group_norm, memory, winograd  # noqa: F401  (each registers its patcher)
from .record import PatchRecord
from .registry import PATCHERS

# The pipeline parts the patch touches, in order; ``ignore=`` skips some of them.
PARTS = ("unet", "vae")
SUPPORTED_MODELS = ("UNet2DConditionModel", "AutoencoderKL")
_ATTR = "_sd_kernels_patch"


def _models_of(obj: object, ignore: Iterable[str]) -> list[tuple[str, nn.Module]]:
    ignore = set(ignore)
    unknown = ignore - set(PARTS)
    if unknown:
        raise ValueError(f"ignore= names unknown parts {sorted(unknown)}; parts are {PARTS}")
    if isinstance(obj, nn.Module):
        if type(obj).__name__ not in SUPPORTED_MODELS:
            raise TypeError(
                f"cannot patch a {type(obj).__name__}; supported models: {', '.join(SUPPORTED_MODELS)}, "
                "or a diffusers pipeline built on them"
            )
        return [(type(obj).__name__, obj)]
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        raise TypeError(
            f"cannot patch a {type(obj).__name__}: expected a diffusers pipeline or one of "
            f"{', '.join(SUPPORTED_MODELS)}"
        )
    models = [
        (part, components[part])
        for part in PARTS
        if part not in ignore
        and isinstance(components.get(part), nn.Module)
        and type(components[part]).__name__ in SUPPORTED_MODELS
    ]
    if not models and not ignore:
        raise TypeError(
            f"{type(obj).__name__} has none of the parts sd_kernels patches ({', '.join(PARTS)} "
            f"as {', '.join(SUPPORTED_MODELS)})"
        )
    return models


def patch(
    obj: object,
    profile: str | None = None,
    ops: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
) -> PatchRecord:
    """Route ``obj``'s supported parts through sd_kernels; returns the record (``.summary()``).

    ``ops`` picks op families (default: all of ``PATCHERS``); ``ignore`` skips pipeline parts.
    Patching an already patched object with the same arguments does nothing; with other arguments
    it is unpatched first.
    """
    ops = tuple(sorted(PATCHERS)) if ops is None else tuple(sorted(set(ops)))
    unknown = set(ops) - set(PATCHERS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; available: {', '.join(sorted(PATCHERS))}")
    prof = set_profile(profile)
    models = _models_of(obj, ignore)
    old: PatchRecord | None = getattr(obj, _ATTR, None)
    if old is not None:
        if old.ops == ops and old.profile == prof.name and old.parts == [p for p, _ in models]:
            return old
        unpatch(obj)
    record = PatchRecord(ops, prof.name, [p for p, _ in models])
    for _, model in models:
        for op in ops:
            PATCHERS[op](model, record)
    object.__setattr__(obj, _ATTR, record)
    return record


def unpatch(obj: object) -> bool:
    """Undo ``patch(obj)`` exactly; returns False if ``obj`` was not patched."""
    record: PatchRecord | None = getattr(obj, _ATTR, None)
    if record is None:
        return False
    record.undo()
    object.__delattr__(obj, _ATTR)
    return True


def patch_record(obj: object) -> PatchRecord | None:
    return getattr(obj, _ATTR, None)


@contextlib.contextmanager
def patched(obj: object, **kwargs) -> Iterator[PatchRecord]:
    """``with patched(pipe): ...`` runs the block patched and restores ``pipe`` afterwards."""
    record = patch(obj, **kwargs)
    try:
        yield record
    finally:
        unpatch(obj)
