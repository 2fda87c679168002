"""The GPU half of test_peer_gather.py: each process of ``torchrun --nproc_per_node W`` (NCCL, one GPU a
process) gathers shards through patches/peer_gather.py and writes what it saw to ``OUT/rank<r>.json``.

Cases: the gather equals NCCL's ``all_gather_into_tensor`` to the bit (bf16, a batch of one and of two,
FLUX's [B, S_local, 2, H, D] layout at a small size); a shard written straight into ``buffer()`` is
sent with no copy; the ring's attention over the gathered keys taken in parts as they arrive is within
three times the error of one attention call over all of them (float64 reference); twenty gathers in a
row; six back to back with no host sync while process 1 reads each late (the barrier that guards the
buffer's reuse: without it process 1 would read the next exchange's values); the same calls captured in
one CUDA graph and replayed on new shards.
"""

import json
import os
import pathlib
import sys
import traceback
import types

import torch
import torch.distributed as dist
from sd_kernels.patches import context_parallel, peer_gather

from sd_kernels import reference


def shard(rank: int, step: int, shape) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)


def nccl_gather(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x)
    return out


def gather(x: torch.Tensor, group) -> torch.Tensor:
    pending = peer_gather.start(x, group)
    assert pending is not None, "the copy-engine exchange did not serve a CUDA bf16 shard"
    got = pending.wait().clone()
    pending.release()
    return got


class _SlowAfterFirstBarrier:
    """A symmetric-memory handle whose process 1 sleeps on the exchange's stream between the first barrier
    and its copies: the other processes run ahead into their next exchange meanwhile."""

    def __init__(self, handle, rank: int) -> None:
        self.handle, self.rank = handle, rank

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self.handle.barrier(channel=channel, timeout_ms=timeout_ms)
        if channel == 0 and self.rank == 1:
            torch.cuda._sleep(20_000_000)  # about 10 ms

    def __getattr__(self, name):
        return getattr(self.handle, name)


def delayed_reader(rank: int, group) -> bool:
    """Six exchanges back to back with no host sync between them while process 1 reads late: each result
    equals NCCL's gather of that exchange's shards (a slot overwritten before every process read it would
    show the next exchange's values)."""
    shape = (1, 48, 2, 3, 64)
    gather(shard(rank, 50, shape), group)  # makes the exchange for this shape
    exchange = peer_gather._EXCHANGES[peer_gather._key(group, shape, torch.bfloat16, torch.device("cuda", rank))]
    exchange.handle = _SlowAfterFirstBarrier(exchange.handle, rank)
    try:
        got = []
        for s in range(51, 57):
            pending = peer_gather.start(shard(rank, s, shape), group)
            got.append(pending.wait().clone())
            pending.release()
    finally:
        exchange.handle = exchange.handle.handle
    return all(torch.equal(g, nccl_gather(shard(rank, s, shape))) for g, s in zip(got, range(51, 57)))


def cases(rank: int, group) -> dict:
    seen = {}
    for b in (1, 2):
        shape = (b, 40, 2, 3, 64)
        x = shard(rank, 0, shape)
        seen[f"equal_b{b}"] = bool(torch.equal(gather(x, group), nccl_gather(x)))
        into = peer_gather.buffer(group, shape, x.dtype, x.device)
        into.copy_(shard(rank, 1, shape))
        pending = peer_gather.start(into, group)
        seen[f"in_place_b{b}"] = bool(torch.equal(pending.wait(), nccl_gather(into.clone())))
        pending.release()
    shape = (1, 40, 2, 3, 64)
    # the ring's attention over the gathered keys: whole, and in parts as they arrive, against float64
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ring_degree=dist.get_world_size()))
    ok = True
    for b in (1, 2):  # a batch of two: each process's slot is [2, 40, 2, 3, 64], the keys batch-major after
        query, kv = shard(rank, 40, (b, 40, 3, 64)), shard(rank, 41, (b, *shape[1:]))
        keys = nccl_gather(kv).unflatten(0, (-1, b)).transpose(0, 1).flatten(1, 2).double()
        want = reference.sdpa(*(x.permute(0, 2, 1, 3) for x in (query.double(), keys[:, :, 0], keys[:, :, 1])))
        want = want.permute(0, 2, 1, 3)
        errors = {}
        for in_parts in (False, True):
            got = context_parallel.attend_gathered(query, peer_gather.start(kv, group), config, in_parts)
            errors[in_parts] = (got.double() - want).abs().max().item()
        ok &= errors[True] <= 3 * errors[False] + 2.0 ** -9
    seen["in_parts_error"] = ok
    seen["in_a_row"] = all(torch.equal(gather(shard(rank, s, shape), group), nccl_gather(shard(rank, s, shape)))
                           for s in range(2, 22))
    seen["delayed_reader"] = delayed_reader(rank, group)
    # captured: five gathers of one static input per replay, their results summed into one static output
    static_in = shard(rank, 0, shape)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def run():
        total = torch.zeros((dist.get_world_size(), *shape[1:]), device="cuda", dtype=torch.float32)
        for k in range(5):
            pending = peer_gather.start(static_in * (k + 1), group)
            total += pending.wait().float()
            pending.release()
        return total

    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    ok = True
    for step in range(30, 33):
        static_in.copy_(shard(rank, step, shape))
        graph.replay()
        want = sum(nccl_gather(static_in * (k + 1)).float() for k in range(5))
        ok &= bool(torch.equal(static_out, want))
    seen["graph_replays"] = ok
    return seen


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    try:
        with torch.no_grad():  # inference, as a pipeline's call: the exchange steps aside under autograd
            seen = cases(rank, dist.group.WORLD)
    except Exception:  # reported to the test, which shows it
        seen = {"crashed": traceback.format_exc()}
    torch.cuda.synchronize()
    peer_gather.release_all()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
