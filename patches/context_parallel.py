"""sd_kernels' attention under diffusers' context parallelism: Ulysses' local attention, and ring.

diffusers 0.42.1's context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(
ulysses_degree=…, ring_degree=…))``) splits the transformer's token sequence over the processes (hooks
on the model's inputs and on ``proj_out``, which gathers) and sets the config on every attention
processor as ``_parallel_config``. Its processors hand it to ``dispatch_attention_fn``, whose
backends pass their own local attention, as a ``forward_op``, to the templates of
``diffusers.models.attention_dispatch`` (``_templated_context_parallel_attention``): Ulysses exchanges
q, k and v by all-to-all so that each process holds the whole sequence for 1/W of the heads, runs
``forward_op`` on them, and exchanges the output back; ring keeps the queries and passes the keys and
values around, merging the partial outputs with their log-sum-exps.

``attention`` here calls that template with sd_kernels' attention (``ops.custom_ops.attention``:
FlashAttention, the partial softmax or SDPA, as the profile says) as the ``forward_op``, for a
Ulysses-only config (``ring_degree`` 1, ``ulysses_anything`` or not). The backward op is diffusers'
native one, which recomputes SDPA from what the forward op saved (the native forward op's way), so
autograd through it still has gradients. The templates are diffusers' own code, called as its backends
call them; they are used only where the installed diffusers has the very source checked
(patches/diffusers_sources.py), else diffusers' dispatch runs everything.

A ring-only config (``ulysses_degree`` 1): diffusers' ring template all-gathers every process's keys
and values (one collective), then calls the local attention once per process's block of them with
``return_lse`` and merges the partial outputs by their log-sum-exps in fp32 (elementwise ops between
the calls). ``gathered_attention`` gathers the same keys and values in one collective, laid out so that
the whole sequence's keys (and values) are one strided view, with no copy at a batch of one
(``ops.rope.kv_layout``; FLUX's ``qk_norm_rope_kv`` writes them so in the first place, into the
exchange's buffer where it has one: ``kv_buffer``), and runs sd_kernels' attention once over all of
them: the same exact attention, in one kernel, with no log-sum-exp to return and nothing to merge. On
GPUs the gather runs on the copy engines over symmetric memory where torch can set that up
(patches/peer_gather.py), taking no SMs from the work beside it; else NCCL runs it. Its two halves
(``gather_kv``, ``attend_gathered``) let a caller queue independent work while the exchange runs:
FLUX's single-stream blocks run their MLP there (patches/layer_norm.py). Ulysses × ring and
``ring_anything`` go to diffusers' dispatch (``serves``).
The buffer's layout is not diffusers' (its ring sends ``cat(k.flatten(), v.flatten())``): every process
must run this path, which ``enable_context_parallel`` checks (the same processors on every process), as
does a patch of a model already split (the same patch on every process).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from sd_kernels.ops.attention_parts import attention_lse, merge_attention
from sd_kernels.ops.custom_ops import attention as sdk_attention
from sd_kernels.ops.rope import kv_layout

from . import peer_gather
from .cfg_parallel import same_patch
from .cuda_graph import context_parallel as under_context_parallel
from .diffusers_sources import is_verified

# diffusers' code this calls and whose calling convention (forward_op's arguments, what the native
# backward reads from ctx) it relies on.
_CALLED = ("_templated_context_parallel_attention", "_native_attention_forward_op", "_native_attention_backward_op")
_TEMPLATES = ("TemplatedUlyssesAttention", "TemplatedUlyssesAnythingAttention")


def _dispatch_module():
    from diffusers.models import attention_dispatch

    return attention_dispatch


_VERIFIED: bool | None = None  # verified()'s answer: read as a constant where torch.compile traces a call


def verified() -> bool:
    """Whether the installed diffusers has the template code this was written against (decided once: the
    patch asks first, eagerly)."""
    global _VERIFIED
    if _VERIFIED is None:
        d = _dispatch_module()
        _VERIFIED = (all(is_verified(getattr(d, name)) for name in _CALLED)
                     and all(is_verified(getattr(d, name).forward) for name in _TEMPLATES))
    return _VERIFIED


def ulysses_degree(parallel_config) -> int | None:
    """The Ulysses degree of a context-parallel config whose local attention sd_kernels runs (ring
    degree 1), else None (no context parallelism, or a ring: ``ring_degree``)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or cp.ring_degree != 1 or cp.ulysses_degree <= 1:
        return None
    return cp.ulysses_degree


def ring_degree(parallel_config) -> int | None:
    """The ring degree of a ring-only context-parallel config (Ulysses degree 1) that ``gathered_attention``
    serves, else None. ``ring_anything`` (shards of different lengths, which diffusers pads before its
    gather) is left to diffusers' dispatch: the gather here takes shards of one length."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or cp.ulysses_degree != 1 or cp.ring_degree <= 1 or getattr(cp, "ring_anything", False):
        return None
    return cp.ring_degree


def serves(parallel_config) -> bool:
    """Whether sd_kernels runs the attention under ``parallel_config`` (Ulysses on the verified templates,
    or ring), rather than diffusers' dispatch."""
    if ring_degree(parallel_config) is not None:
        return True
    return ulysses_degree(parallel_config) is not None and verified()


def check_heads(heads: int, parallel_config, where: str) -> None:
    """A clear error for a head count the Ulysses degree does not divide (diffusers' template would
    fail in a reshape); ``ulysses_anything`` pads the heads itself."""
    degree = ulysses_degree(parallel_config)
    if degree is None or parallel_config.context_parallel_config.ulysses_anything or heads % degree == 0:
        return
    raise ValueError(f"{where}: Ulysses attention gives each of the {degree} processes 1/{degree} of the heads, and "
                     f"{degree} does not divide {heads} heads: choose a ulysses_degree that divides {heads}, or "
                     "ContextParallelConfig(ulysses_degree=..., ulysses_anything=True)")


def check_setup(models: list, profile, ops: tuple[str, ...], graph_mode: str | None, compile: str | None) -> None:
    """Patching a model already under context parallelism: every process of its mesh patches alike (a
    collective over that mesh, as ``enable_parallelism`` was; a patch made before ``enable_parallelism``
    cannot be checked so)."""
    parallel = [(part, m) for part, m in models if under_context_parallel(m)]
    if parallel:
        group = parallel[0][1]._parallel_config.context_parallel_config._flattened_mesh.get_group()
        same_patch(group, parallel, profile, ops, graph_mode, compile, "context parallelism")


def _forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                return_lse=False, _save_ctx=True, _parallel_config=None):
    """The local attention on [B, S, H, D] (the whole sequence, this process's heads): sd_kernels'
    attention on the [B, H, S, D] views. What it saves for backward is what diffusers' native forward
    op saves (its backward recomputes SDPA from it)."""
    if return_lse or attn_mask is not None or dropout_p or is_causal or enable_gqa:
        raise ValueError("sd_kernels' context-parallel attention takes no log-sum-exp, mask, dropout, causal or GQA "
                         "call (those go to diffusers' dispatch)")
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.attn_mask, ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.enable_gqa = None, 0.0, False, scale, False
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    return sdk_attention(q, k, v, scale=scale).permute(0, 2, 1, 3)


# torch's functional all-gather (all_gather_tensor's newer name, which warns of its deprecation where the new
# one exists; the newer one is differentiable): every all-gather of sd_kernels' context parallelism
all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)


def waited(x: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (a plain tensor as it is)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _ring_group(parallel_config):
    return parallel_config.context_parallel_config._ring_mesh.get_group()


def kv_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, parallel_config) -> torch.Tensor | None:
    """Where this process's [B, S_local, 2, H, D] keys and values may be written for ``gather_kv`` to send
    with no copy (its slice of the copy-engine exchange's buffer, patches/peer_gather.py), or None."""
    return peer_gather.buffer(_ring_group(parallel_config), shape, dtype, device)


def gather_kv(kv: torch.Tensor, parallel_config):
    """The all-gather of this process's [B, S_local, 2, H, D] ``kv`` over the ring's processes, started and
    not waited for: on the copy engines over symmetric memory (patches/peer_gather.py) where that serves,
    else torch.distributed's functional collective (NCCL; its autograd form where a gradient flows). The
    caller may queue other work before ``attend_gathered`` waits (the exchange then overlaps it)."""
    group = _ring_group(parallel_config)
    if (pending := peer_gather.start(kv, group)) is not None:
        return pending
    if torch.is_grad_enabled() and kv.requires_grad:
        return getattr(funcol, "all_gather_tensor_autograd", all_gather)(kv, 0, group)
    return all_gather(kv, 0, group)


def attend_gathered(query: torch.Tensor, gathered, parallel_config, in_parts: bool = False) -> torch.Tensor:
    """Exact attention of this process's [B, S_local, H, D] queries over every process's keys and values
    (``gather_kv``'s result, [W·B, S_local, 2, H, D], waited for here): one call of sd_kernels' attention
    on strided views. Keys are taken in rank order; attention does not depend on their order, only on
    each key meeting its value.

    ``in_parts`` (where nothing else is queued to run beside the exchange: FLUX's double-stream blocks),
    for an exchange on the copy engines: attention to this process's own keys at once, then to each other
    process's as they arrive, each part with its log-sum-exp, merged (``ops.attention_parts``: exact up
    to the parts' rounding before the merge), so the copies run under the attention instead of before it."""
    world = parallel_config.context_parallel_config.ring_degree
    if in_parts and isinstance(gathered, peer_gather.Gathered):
        out = _attend_arrivals(query, gathered, world)
    else:
        kv = gathered.wait() if isinstance(gathered, peer_gather.Gathered) else waited(gathered)
        bsz, s_local = query.shape[0], kv.shape[1]
        if bsz == 1:
            kv = kv.view(1, world * s_local, *kv.shape[2:])
        else:  # process-major along dim 0: [B, W·S_local, ...] takes a copy
            kv = kv.unflatten(0, (world, bsz)).transpose(0, 1).flatten(1, 2)
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, kv[:, :, 0], kv[:, :, 1]))
        out = sdk_attention(q, k, v).permute(0, 2, 1, 3)
    if isinstance(gathered, peer_gather.Gathered):
        gathered.release()  # the buffer's next writer waits for every process's reads of it
    return out


def _attend_arrivals(query: torch.Tensor, gathered: peer_gather.Gathered, world: int) -> torch.Tensor:
    """Attention over each process's slot of keys and values as it arrives, the parts merged in fp32 and
    rounded to the queries' dtype at the last merge: [B, S_local, H, D]."""
    q = query.permute(0, 2, 1, 3)
    acc = None
    for i, (_, slot) in enumerate(gathered.arrivals()):
        part = attention_lse(q, slot[:, :, 0].permute(0, 2, 1, 3), slot[:, :, 1].permute(0, 2, 1, 3))
        acc = part if acc is None else merge_attention(acc, part, query.dtype if i == world - 1 else torch.float32)
    return acc[0].permute(0, 2, 1, 3)


def gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, parallel_config) -> torch.Tensor:
    """Ring attention of [B, S_local, H, D] q, k, v in one piece: ``kv_layout``, ``gather_kv``,
    ``attend_gathered``."""
    return attend_gathered(query, gather_kv(kv_layout(key, value), parallel_config), parallel_config)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, parallel_config) -> torch.Tensor:
    """diffusers' context-parallel attention of [B, S_local, H, D] q, k, v with sd_kernels' attention (for a
    config ``serves`` accepts): ring by ``gathered_attention``, Ulysses by diffusers' template."""
    if ring_degree(parallel_config) is not None:
        return gathered_attention(query, key, value, parallel_config)
    d = _dispatch_module()
    return d._templated_context_parallel_attention(
        query, key, value, forward_op=_forward_op, backward_op=d._native_attention_backward_op,
        _parallel_config=parallel_config)
