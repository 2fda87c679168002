"""NCCL's all-gather and all-to-all between this host's GPUs at FLUX's per-attention sizes (one process per
GPU under torchrun): eager and replayed from a CUDA graph; the environment's NCCL settings printed.

    torchrun --standalone --nproc_per_node W probe_nccl.py
"""
import os
import torch
import torch.distributed as dist


def timed_us(fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    w = dist.get_world_size()
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL", "TORCH_NCCL", "TORCH_SYMM"))}
    if rank == 0:
        print("W", w, "env", env, "nccl", torch.cuda.nccl.version(), flush=True)
    tokens = 4608 // w
    for what, numel in (("kv (2 x S/W x 3072)", tokens * 2 * 3072), ("one of q/k/v/o (S/W x 3072)", tokens * 3072)):
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(numel * w, device="cuda", dtype=torch.bfloat16)
        a2a = torch.empty_like(x)
        ag = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
        aa = lambda: dist.all_to_all_single(a2a, x)  # noqa: E731
        res = {}
        for name, fn in (("all_gather", ag), ("all_to_all", aa)):
            res[name] = timed_us(fn)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            res[name + " graph"] = timed_us(g.replay)
        mb = numel * 2 / 1e6
        if rank == 0:
            recv = {"all_gather": mb * (w - 1), "all_to_all": mb * (w - 1) / w}
            print(f"{what}: {mb:.1f} MB a process: " + ", ".join(
                f"{k} {v:.1f} us ({recv[k.split()[0]] / v * 1e3:.0f} GB/s received)" for k, v in res.items()), flush=True)
    torch.cuda.synchronize()
    dist.barrier()


if __name__ == "__main__":
    main()
