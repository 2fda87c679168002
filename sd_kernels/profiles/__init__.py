"""Device profiles: which kernels run on which GPU class.

A profile is data. This first version carries a name, the GPU classes it matches and the ops it
switches off; memory budgets, on-chip limits and attention/Winograd policies join it in the
profiles issue. ``SD_KERNELS_PROFILE`` or ``set_profile`` override detection.
"""

from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    min_capability: tuple[int, int] | None = None  # CUDA compute capability this profile needs
    disabled_ops: frozenset[str] = frozenset()

    def disabled_reason(self, op: str) -> str | None:
        if op in self.disabled_ops:
            return f"profile {self.name!r} disables {op}"
        return None


_CATALOG = {
    p.name: p
    for p in (
        Profile("hopper", "NVIDIA Hopper (H100, H200): sm_90", (9, 0)),
        Profile("ampere", "NVIDIA Ampere and Ada (A100, A10, RTX 30xx/40xx): sm_80-sm_89", (8, 0)),
        Profile("cuda", "Any other CUDA GPU that Triton supports (sm_70+)", (7, 0)),
        Profile("cpu", "No GPU: the PyTorch reference, or Triton's interpreter when TRITON_INTERPRET=1"),
    )
}
_active: Profile | None = None


def list_profiles() -> list[str]:
    return list(_CATALOG)


def detect_profile(capability: tuple[int, int] | None) -> Profile:
    """The most specific catalog profile for a CUDA capability (None: no GPU)."""
    if capability is None:
        return _CATALOG["cpu"]
    for p in _CATALOG.values():
        if p.min_capability is not None and capability >= p.min_capability:
            return p
    return _CATALOG["cpu"]


def get_profile(name: str | None = None) -> Profile:
    """The named profile, else $SD_KERNELS_PROFILE, else the one detected for the current GPU."""
    name = name or os.environ.get("SD_KERNELS_PROFILE")
    if name:
        if name not in _CATALOG:
            raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(_CATALOG)}")
        return _CATALOG[name]
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return detect_profile(cap)


def active_profile() -> Profile:
    global _active
    if _active is None:
        _active = get_profile()
    return _active


def set_profile(name: str | None) -> Profile:
    """Make ``name`` (or the detected profile, for None) the one dispatch consults."""
    global _active
    _active = get_profile(name)
    return _active
