"""Memory-layout helpers shared by the ops' launchers (host side, no Triton)."""

from __future__ import annotations

import torch


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (size-0 dims count as 1, as torch does)."""
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def vectors(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The per-channel vectors a kernel reads as ``ptr + index`` (biases, norm weights, row scales), each
    made contiguous: a strided or expanded view passes the ops' shape checks and would otherwise be read
    as the wrong elements. A no-op (the same tensor) for a module's own parameters; None stays None."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def check_writable(op: str, **outputs: torch.Tensor | None) -> None:
    """Raise where an output given by the caller has elements that share memory (a dimension of size
    above 1 with stride 0: an expanded view), as torch's own ops refuse such outputs; a kernel would
    write each of those elements several times, the last write winning."""
    for name, t in outputs.items():
        if t is not None and any(step == 0 and size > 1 for size, step in zip(t.shape, t.stride())):
            raise ValueError(f"{op}: {name} has elements that share memory (an expanded view, shape "
                             f"{list(t.shape)}, strides {list(t.stride())}); give it memory of its own")


def is_dense(x: torch.Tensor) -> bool:
    """True if x's elements fill a block of storage with no gaps or overlaps, in some dim order."""
    if x.is_contiguous():
        return True
    order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)
    return x.permute(order).is_contiguous()


def is_channels_last(x: torch.Tensor) -> bool:
    """A 4-D tensor laid out NHWC (and not also NCHW-contiguous, as 1×1 maps or one channel are)."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def misaligned(*tensors: torch.Tensor | None) -> bool:
    """Whether any tensor's data starts off a 16-byte boundary (a view at an odd element offset)."""
    return any(t is not None and t.data_ptr() % 16 for t in tensors)


def realigned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a copy in fresh (aligned) memory if its data starts off a 16-byte boundary; the copy
    keeps t's strides where t is dense (``clone``'s preserve_format), else it is contiguous."""
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()
