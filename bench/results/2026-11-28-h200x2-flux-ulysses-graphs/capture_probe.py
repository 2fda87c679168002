"""An NCCL all-to-all (torch's functional collectives, as diffusers' Ulysses template calls them) captured in
a CUDA graph and replayed on two GPUs: ``torchrun --standalone --nproc_per_node 2 capture_probe.py``.
Each process prints its rank and the replayed result, (x + 1)·2 exchanged: rank 0 [2, 4, 6, 8, 202, ...],
rank 1 [10, 12, 14, 16, 210, ...]."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
x = torch.arange(8, device="cuda", dtype=torch.float32) + 100 * rank
funcol.wait_tensor(funcol.all_to_all_single(x, None, None, dist.group.WORLD))  # the communicator, before capture
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
graph = torch.cuda.CUDAGraph()
with torch.cuda.stream(side):
    funcol.wait_tensor(funcol.all_to_all_single(x * 2, None, None, dist.group.WORLD))  # warm-up on the side stream
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=side):
        out = funcol.wait_tensor(funcol.all_to_all_single(x * 2, None, None, dist.group.WORLD))
x.add_(1)
graph.replay()
torch.cuda.synchronize()
print(rank, out.tolist(), flush=True)
dist.destroy_process_group()
