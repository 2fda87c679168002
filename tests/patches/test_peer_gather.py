"""patches/peer_gather.py: the ring's key/value all-gather on the copy engines over symmetric memory.

On two and on four GPUs (a ``torchrun`` launch of peer_gather_worker.py each, NCCL): equal to NCCL's all-gather to the
bit, in place from ``buffer()``, attended in parts as the slots arrive, many in a row, and replayed from a
CUDA graph. Here, on the CPU: the
calls it does not serve return None (the caller then runs NCCL's collective), and a process group on
which symmetric memory cannot be set up gets no exchange, on every process.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from sd_kernels.patches import context_parallel, peer_gather

from sd_kernels import reference

WORKER = os.path.join(os.path.dirname(__file__), "peer_gather_worker.py")


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    peer_gather.release_all()
    dist.destroy_process_group()


def test_calls_it_does_not_serve_go_to_nccl(monkeypatch):
    """CPU tensors, autograd enabled (even with no gradient through the shard: one through the queries
    would meet a buffer the next exchange overwrites), a non-contiguous shard: None before any set-up."""
    x = torch.randn(1, 4, 2, 3, 8)
    with torch.no_grad():
        assert peer_gather.start(x, group=None) is None  # on the CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert peer_gather.start(x, group=None) is None  # grad enabled
    with torch.no_grad():
        assert peer_gather.start(x.transpose(1, 3), group=None) is None
    assert peer_gather.buffer(None, x.shape, x.dtype, x.device) is None  # grad enabled: nothing to write into


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_a_group_without_symmetric_memory_gets_no_exchange(one_process_group, monkeypatch, caplog):
    """Set-up fails (here: CPU memory, which symmetric memory does not take): a warning, None, and the
    failure remembered (no second attempt); the shape has no buffer to write into."""
    monkeypatch.setattr(peer_gather, "_usable", lambda shard: True)
    x = torch.randn(1, 4, 2, 3, 8)
    assert peer_gather.start(x, one_process_group) is None
    assert "symmetric memory could not be set up" in caplog.text
    key = peer_gather._key(one_process_group, x.shape, x.dtype, x.device)
    assert peer_gather._EXCHANGES == {key: None}
    with torch.no_grad():
        assert peer_gather.buffer(one_process_group, x.shape, x.dtype, x.device) is None


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_the_switch_to_nccl_is_read_once_per_shape_and_checked(one_process_group, monkeypatch, caplog):
    """SD_KERNELS_RING_EXCHANGE=nccl: no set-up is tried (every process agrees first); another value is a
    clear error."""
    monkeypatch.setattr(peer_gather, "_usable", lambda shard: True)
    monkeypatch.setattr(peer_gather, "_Exchange", lambda *a: pytest.fail("set-up tried under nccl"))
    monkeypatch.setenv(peer_gather.ENV, "nccl")
    x = torch.randn(1, 4, 2, 3, 8)
    assert peer_gather.start(x, one_process_group) is None
    assert not peer_gather.in_use()
    monkeypatch.setenv(peer_gather.ENV, "nvlink")
    with pytest.raises(ValueError, match="'copy' \\(the default\\) or 'nccl'"):
        peer_gather.start(torch.randn(2, 4, 2, 3, 8), one_process_group)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with the gloo backend")
def test_the_exchange_made_under_inference_mode_holds_no_inference_tensors(one_process_group, monkeypatch):
    """The first call under ``torch.inference_mode()`` sets the exchange up outside it: a later call outside inference
    mode copies its shard into the buffers in place, which inference tensors would refuse."""
    made = []

    class Exchange:
        def __init__(self, group, shape, dtype, device):
            self.full = torch.zeros(shape, dtype=dtype)
            made.append(torch.is_inference_mode_enabled())

        def start(self, shard):
            self.full.copy_(shard)
            return self.full

    monkeypatch.setattr(peer_gather, "_usable", lambda shard: True)
    monkeypatch.setattr(peer_gather, "_Exchange", Exchange)
    x = torch.randn(1, 4, 2, 3, 8)
    with torch.inference_mode():
        assert torch.equal(peer_gather.start(x, one_process_group), x)
    with torch.no_grad():
        assert torch.equal(peer_gather.start(x * 2, one_process_group), x * 2)
    assert made == [False]


class _Arrived:
    """A stand-in for an exchange whose slots arrive in a given order (``Gathered.arrivals``' contract)."""

    def __init__(self, full: torch.Tensor, order: list[int]) -> None:
        self.full, self.order = full, order

    def arrivals(self):
        yield from ((r, self.full[r:r + 1]) for r in self.order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_arrivals_is_attention_over_every_process_keys(dtype):
    """Three processes' keys taken as they arrive (own first, then 2, then 0: the parts merged in fp32 and
    rounded once) equal attention over all of them within the dtype's rounding; [B, S, H, D] out."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 7, 3, 16, generator=g).to(dtype)
    full = torch.randn(3, 7, 2, 3, 16, generator=g).to(dtype)
    got = context_parallel._attend_arrivals(query, _Arrived(full, [1, 2, 0]), world=3)
    keys = full.reshape(1, 21, 2, 3, 16).double()
    want = reference.sdpa(*(x.permute(0, 2, 1, 3) for x in (query.double(), keys[:, :, 0], keys[:, :, 1])))
    assert got.shape == query.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 2 * 2.0 ** -8
    assert (got.double() - want.permute(0, 2, 1, 3)).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_gather_equals_nccl_on_several_gpus(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (one process each)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                          WORKER, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for r in range(world):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "crashed" not in seen, seen.get("crashed")
        assert seen == {"equal_b1": True, "in_place_b1": True, "equal_b2": True, "in_place_b2": True,
                        "in_parts_error": True, "in_a_row": True, "delayed_reader": True, "graph_replays": True}, seen
