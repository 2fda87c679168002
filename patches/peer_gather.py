"""The ring's all-gather of keys and values on the GPUs' copy engines, over symmetric memory.

NCCL's all-gather is a kernel: it takes SMs for as long as it runs, so the work queued beside it (FLUX's
single-stream MLP, patches/layer_norm.py) slows down by about what the exchange would have cost alone
(bench/results/2026-11-28-h200x4-flux-ring: a 137 µs gather and a 231 µs GEMM take 306 µs together).
A copy between GPUs by ``cudaMemcpyAsync`` runs on a copy engine and takes no SM. Here every process
keeps one buffer of the whole gathered tensor, [W·B, S_local, 2, H, D], allocated in symmetric memory
(``torch.distributed._symmetric_memory``: each process maps the others' buffers into its address
space); a process writes its own shard into its slice of its buffer, and then, on a high-priority stream
of its own:

1. ``barrier`` (channel 0): every process's shard is written;
2. pulls each other process's slice from that process's buffer into the same slice of its own, one
   copy-engine copy per peer, the i-th from rank + i (so that no two processes read one peer's memory
   at once), recording an event after each: the attention may start on the slots that have arrived
   (``Gathered.arrivals``) or wait for all (``Gathered.wait``). Copies on separate streams measured no
   faster: the peer copies of one GPU ran one after another (42 µs for each 14.2 MB on four H200s either
   way);
3. ``barrier`` (channel 1): every process has finished reading this process's slice, which the next
   exchange may then overwrite; recorded as ``done``, which the caller's stream waits for after it
   has queued the attention (so the wait delays nothing already queued, and a CUDA graph's capture
   sees the side stream joined).

One buffer per (group, shape, dtype, device), made at first use by a collective ``rendezvous`` (every
process runs the same calls in the same order, as its model's forward does); never made while a CUDA
graph is being captured (the capture's warm-up call makes it). Where symmetric memory cannot be set up
on some process (no peer access, an old torch), or some process sets ``SD_KERNELS_RING_EXCHANGE=nccl``,
every process takes NCCL for that shape (the set-up agrees by two all-reduces); under autograd or
``torch.compile`` ``start`` returns None too, and the caller uses torch's functional all-gather, which
NCCL runs. A barrier that waits more than ``BARRIER_TIMEOUT_MS`` for the others stops the process with an
error. The buffers live until ``release_all()``, which must come after every CUDA graph that captured an
exchange is released (``unpatch``) and before the process group ends: the command line and
bench.parallel do so.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from .modes import outside_inference_mode

log = logging.getLogger(__name__)

ENV = "SD_KERNELS_RING_EXCHANGE"  # "copy" (the default where it works) or "nccl"
STREAM_PRIORITY = -1  # the exchange's stream: high (CUDA's lower number), see _Exchange
# A barrier waits this long for the other processes (a first call may compile for a minute on one of them),
# then stops the process with an error instead of spinning forever behind one that died
BARRIER_TIMEOUT_MS = 10 * 60 * 1000


class Gathered:
    """An exchange under way. ``wait()`` makes the caller's stream wait for the whole gathered tensor and
    returns it; ``arrivals()`` yields each process's slot as it arrives instead (this process's first, then
    the others in the order they are copied), the caller's stream made to wait for it; ``release()``, called
    once the caller has queued its reads, joins the exchange's stream."""

    def __init__(self, exchange: _Exchange, arrived: dict[int, torch.cuda.Event], done: torch.cuda.Event) -> None:
        self.full, self._exchange, self._arrived, self._done = exchange.full, exchange, arrived, done

    def wait(self) -> torch.Tensor:
        for event in self._arrived.values():
            torch.cuda.current_stream().wait_event(event)
        return self.full

    def arrivals(self):
        """(rank, that process's [B, S_local, ...] slot), this process's first (no wait), then the others'."""
        yield self._exchange.rank, self._exchange.slot(self._exchange.rank, self.full)
        for rank, event in self._arrived.items():
            torch.cuda.current_stream().wait_event(event)
            yield rank, self._exchange.slot(rank, self.full)

    def release(self) -> None:
        torch.cuda.current_stream().wait_event(self._done)


class _Exchange:
    """One symmetric buffer and the stream its barriers and copies run on."""

    def __init__(self, group, shard_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group  # held: the key's id(group) stays this group's
        self.world, self.rank = group.size(), group.rank()
        self.batch = shard_shape[0]
        shape = (self.world * self.batch, *shard_shape[1:])
        with warnings.catch_warnings():  # needed by older torch, deprecated (a no-op) by newer
            warnings.simplefilter("ignore", FutureWarning)
            getattr(symm_mem, "enable_symm_mem_for_group", lambda name: None)(group.group_name)
        self.full = symm_mem.empty(shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.full, group.group_name)
        # get_buffer counts from the start of the symmetric allocation, where this buffer lies ``offset`` bytes in
        offset = getattr(self.handle, "offset", 0)
        if offset % self.full.element_size():
            raise RuntimeError(f"the buffer lies {offset} bytes into its symmetric allocation, not a whole element")
        self.peers = [self.handle.get_buffer(p, shape, dtype, offset // self.full.element_size())
                      for p in range(self.world)]
        # high priority: the barriers' small kernels start ahead of the blocks of work queued beside them (the
        # attention to this process's own keys, which starts when they do)
        self.stream = torch.cuda.Stream(device, priority=STREAM_PRIORITY)

    def slot(self, rank: int, full: torch.Tensor) -> torch.Tensor:
        return full[rank * self.batch:(rank + 1) * self.batch]

    def start(self, shard: torch.Tensor) -> Gathered:
        mine = self.slot(self.rank, self.full)
        if shard.data_ptr() != mine.data_ptr():
            mine.copy_(shard)
        self.stream.wait_stream(torch.cuda.current_stream())
        arrived, done = {}, torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            for step in range(1, self.world):
                peer = (self.rank + step) % self.world
                self.slot(peer, self.full).copy_(self.slot(peer, self.peers[peer]))
                arrived[peer] = torch.cuda.Event()
                arrived[peer].record()
            self.handle.barrier(channel=1, timeout_ms=BARRIER_TIMEOUT_MS)
            done.record()
        return Gathered(self, arrived, done)


_EXCHANGES: dict[tuple, _Exchange | None] = {}


def _key(group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple:
    # the group object itself, not only its name: torch reuses names for groups made after others ended
    return id(group), group.group_name, tuple(shape), dtype, torch.device(device)


def _eager_inference() -> bool:
    """Outside autograd (a gradient through the queries alone would meet a buffer the next exchange
    overwrites) and torch.compile: where the exchange may run."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _usable(shard: torch.Tensor) -> bool:
    """Whether this call may take the exchange: a contiguous CUDA shard, ``_eager_inference``."""
    return shard.is_cuda and shard.is_contiguous() and _eager_inference()


def _agree(group, flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every process of ``group`` (a collective)."""
    t = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(t.item())


def _make(group, shard: torch.Tensor) -> _Exchange | None:
    """The exchange for ``shard``'s shape, set up by every process together; None (on every process) where
    any process asks for NCCL (``SD_KERNELS_RING_EXCHANGE=nccl``) or could not set it up."""
    wanted = os.environ.get(ENV, "copy")
    if wanted not in ("copy", "nccl"):
        raise ValueError(f"{ENV}={wanted!r}: 'copy' (the default) or 'nccl'")
    if not _agree(group, wanted == "copy", shard.device):
        if wanted == "copy":
            log.warning("sd_kernels: the ring's exchange runs on NCCL: another process set %s=nccl", ENV)
        return None
    try:  # outside inference mode: a call outside it, after one inside, copies into the buffers in place
        with outside_inference_mode():
            exchange, ok = _Exchange(group, tuple(shard.shape), shard.dtype, shard.device), True
    except (RuntimeError, ImportError, AttributeError) as e:  # no peer access, no symmetric memory in this torch
        log.warning("sd_kernels: the ring's exchange runs on NCCL (symmetric memory could not be set up: %s)", e)
        exchange, ok = None, False
    return exchange if _agree(group, ok, shard.device) else None


def buffer(group, shard_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """This process's slice of the exchange's buffer for a shard of ``shard_shape``, for a producer to write
    its shard straight into (then ``start`` sends it with no copy); None where the call would not take the
    exchange (autograd, torch.compile), where there is no buffer yet (``start`` makes it) or none at all."""
    if not _eager_inference():
        return None
    exchange = _EXCHANGES.get(_key(group, shard_shape, dtype, device))
    return None if exchange is None else exchange.slot(exchange.rank, exchange.full)


def start(shard: torch.Tensor, group) -> Gathered | None:
    """The all-gather along dim 0 of every process's ``shard`` over ``group``, started on the copy engines;
    None where this path does not serve the call (the caller then runs NCCL's)."""
    if not _usable(shard):
        return None
    key = _key(group, shard.shape, shard.dtype, shard.device)
    if key not in _EXCHANGES:
        if shard.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # a capture's warm-up call makes the buffer; none is made inside a capture
        _EXCHANGES[key] = _make(group, shard)
    exchange = _EXCHANGES[key]
    return None if exchange is None else exchange.start(shard)


def in_use() -> bool:
    """Whether any exchange runs on the copy engines in this process."""
    return any(e is not None for e in _EXCHANGES.values())


def release_all() -> None:
    """Drop every buffer (before the process group they were made over is destroyed)."""
    _EXCHANGES.clear()
