"""An all-gather of FLUX's keys and values beside the single-stream block's MLP GEMM (one process per GPU under
torchrun): each alone, then the collective started and the GEMM queued before its wait, replayed from a CUDA
graph; with cuBLAS leaving N SMs free (torch._C._set_sm_carveout_experimental) and NCCL's stream at high
priority or not.

    TORCH_NCCL_HIGH_PRIORITY=0|1 torchrun --standalone --nproc_per_node W probe_overlap.py
"""
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def graph_us(fn, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    w, group = dist.get_world_size(), dist.group.WORLD
    tokens = 4608 // w
    kv = torch.randn(1, tokens, 2, 24, 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, 3072, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(12288, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.zeros(12288, device="cuda", dtype=torch.bfloat16)

    def gather():
        return funcol.all_gather_tensor(kv, 0, group).wait()

    def gemm():
        return F.linear(x, wt, bias)

    def both():
        pending = funcol.all_gather_tensor(kv, 0, group)
        y = F.linear(x, wt, bias)
        return pending.wait(), y

    rows = []
    for carveout in (None, 8, 16, 24, 32):
        if carveout is not None:
            torch._C._set_sm_carveout_experimental(carveout)
        rows.append((carveout, graph_us(gather), graph_us(gemm), graph_us(both)))
        torch._C._set_sm_carveout_experimental(None)
    if rank == 0:
        print(f"W {w} high priority {os.environ.get('TORCH_NCCL_HIGH_PRIORITY', '0')}", flush=True)
        for c, g_, m, b in rows:
            print(f"  carveout {c or 0:2d}: gather {g_:6.1f} us, gemm {m:6.1f} us, both {b:6.1f} us "
                  f"(sum {g_ + m:6.1f}, hidden {g_ + m - b:6.1f})", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
