"""The GPU half of test_peer_gather.py: each process of ``torchrun --nproc_per_node W`` (NCCL, one GPU a
process) gathers shards through patches/peer_gather.py and writes what it saw to ``OUT/rank<r>.json``.

Cases: the gather equals NCCL's ``all_gather_into_tensor`` to the bit (bf16, a batch of one and of two,
FLUX's [B, S_local, 2, H, D] layout at a small size); a shard written straight into ``buffer()`` is
sent with no copy; the ring's attention over the gathered keys taken in parts as they arrive is within
three times the error of one attention call over all of them (float64 reference); twenty gathers in a
row, each read before the next overwrites the buffer (the barrier that guards reuse); the same calls
captured in one CUDA graph and replayed on new shards.
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
    query, kv = shard(rank, 40, (1, 40, 3, 64)), shard(rank, 41, shape)
    keys = nccl_gather(kv).view(1, -1, 2, 3, 64).double()
    want = reference.sdpa(*(x.permute(0, 2, 1, 3) for x in (query.double(), keys[:, :, 0], keys[:, :, 1])))
    want = want.permute(0, 2, 1, 3)
    errors = {}
    for in_parts in (False, True):
        got = context_parallel.attend_gathered(query, peer_gather.start(kv, group), config, in_parts)
        errors[in_parts] = (got.double() - want).abs().max().item()
    seen["in_parts_error"] = errors[True] <= 3 * errors[False] + 2.0 ** -9
    seen["in_a_row"] = all(torch.equal(gather(shard(rank, s, shape), group), nccl_gather(shard(rank, s, shape)))
                           for s in range(2, 22))
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
        seen = cases(rank, dist.group.WORLD)
    except Exception:  # reported to the test, which shows it
        seen = {"crashed": traceback.format_exc()}
    torch.cuda.synchronize()
    peer_gather.release_all()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
