"""FLUX's attention on sd_kernels: ``SDKernelsFluxAttnProcessor``.

It is diffusers' ``FluxAttnProcessor.__call__`` (diffusers 0.42.1, models/transformers/transformer_flux.py)
line for line, for both of FLUX's blocks: the double-stream ``FluxTransformerBlock`` (image and text
streams, ``added_kv_proj_dim`` set) and the single-stream ``FluxSingleTransformerBlock`` (one stream of
text and image tokens already concatenated, ``pre_only``: no ``to_out``). The q/k/v projections come
from diffusers' own ``_get_qkv_projections`` (separate ``to_q`` / ``to_k`` / ``to_v``, or after
``transformer.fuse_qkv_projections()`` one ``to_qkv`` GEMM and, for the text stream, one
``to_added_qkv``: diffusers 0.42.1 keeps ``FluxAttnProcessor`` for fused projections and reads
``attn.fused_projections``), unflattened to [B, S, H, D]; ``norm_q`` / ``norm_k`` (and
``norm_added_q`` / ``norm_added_k``) are the module's RMSNorms; the text stream is concatenated in
front of the image stream; the rotary embedding is diffusers' ``apply_rotary_emb`` (``sequence_dim=1``);
after the attention the streams are split back, ``to_out`` on the image's, ``to_add_out`` on the text's.

The q, k and v projections of each stream run as one GEMM on a buffer their three weights share
(patches/qkv_fusion.py: no second copy of the weights, unlike ``fuse_qkv_projections()``), while the
patch's layout holds; diffusers' projections otherwise.

From the projections to the attention's inputs (unflatten, norms, concatenation, rotation) one op runs
instead, ``sd_kernels.ops.qk_norm_rope`` (a launch per stream, writing each stream into the joined
buffers at its offset; docs/kernels/rope.md), where it computes what those lines do: every norm a
``torch.nn.RMSNorm`` over the head dim (what ``FluxAttention`` builds) with one eps, or no norm at all;
``image_rotary_emb`` None or FLUX's (cos, sin) pair of [S_text + S, D]. Anything else (another norm
class, a tensor or complex rotary embedding) runs diffusers' lines as they are.

The attention core: diffusers calls ``dispatch_attention_fn`` on [B, S, H, D], which by default
(its "native" backend) runs ``F.scaled_dot_product_attention`` on the [B, H, S, D] views
``x.permute(0, 2, 1, 3)`` and permutes the result back. Here those views go to
``sd_kernels.ops.custom_ops.attention`` (FlashAttention, the partially fused softmax or stock SDPA, as the
profile says); the kernels read the views in place and write the output with the heads inner, so
the permute back and diffusers' ``flatten(2, 3)`` stay views. Every call the native backend would not
serve goes to diffusers' ``dispatch_attention_fn`` as diffusers calls it: an ``attention_mask`` (only
through ``joint_attention_kwargs``; diffusers' native backend reshapes a [B, S] mask, which this leaves
to it), a backend chosen on the processor (``attn.set_attention_backend``) or for the process
(``DIFFUSERS_ATTN_BACKEND``, the ``attention_backend`` context manager), and context parallelism that
sd_kernels' attention does not serve (Ulysses × ring). Under diffusers' Ulysses context parallelism
(``_parallel_config`` set by ``enable_parallelism``, before or after the patch) the local attention of
diffusers' Ulysses template is sd_kernels'; under ring, sd_kernels gathers the keys and values and runs
one attention over them (patches/context_parallel.py).

patches/attention.py installs it on every ``FluxAttention`` whose processor is exactly
``FluxAttnProcessor`` while that ``__call__`` is the verified source (patches/diffusers_sources.py) and no
backend was set on it; other processors (``FluxIPAdapterAttnProcessor``, NPU / XLA ones, a user's) are
left alone and listed in the record.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from sd_kernels.ops.custom_ops import attention, qk_norm_rope, qk_norm_rope_fp8, qk_norm_rope_kv
from sd_kernels.ops.rope import kv_layout, kv_shape_of
from sd_kernels.profiles import scoped

from . import context_parallel, qkv_fusion
from .diffusers_sources import VERIFIED_WITH, is_verified

KIND = "flux_attention_processor"
_FLUX = "diffusers.models.transformers.transformer_flux"


def flux_module():
    """diffusers' FLUX transformer module, or None where it was never imported (then no model holds
    any of its classes)."""
    return sys.modules.get(_FLUX)


def flux_attention_class() -> type | None:
    """diffusers' ``FluxAttention``, or None (``flux_module``)."""
    module = flux_module()
    return None if module is None else module.FluxAttention


def replacement(processor, attn=None) -> SDKernelsFluxAttnProcessor | str:
    """Our processor for FluxAttention ``attn``'s stock one, or why it is left alone. Under a Ulysses
    config whose degree does not divide ``attn``'s heads: a clear error (context_parallel.check_heads)."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    if type(processor) is not FluxAttnProcessor:
        return f"custom FLUX attention processor (only {FluxAttnProcessor.__name__} is served on FluxAttention)"
    if not is_verified(FluxAttnProcessor.__call__):
        return (f"FluxAttnProcessor.__call__ is not the diffusers {VERIFIED_WITH} code that sd_kernels' FLUX "
                "processor mirrors: left as it is")
    if processor._attention_backend is not None:
        return (f"left as it is: _attention_backend={processor._attention_backend!r} chosen for it (diffusers' "
                "dispatch runs what was chosen)")
    if attn is not None:
        context_parallel.check_heads(attn.heads, processor._parallel_config, type(attn).__name__)
    context_parallel.verified()  # decided here, eagerly, before a call under torch.compile reads it
    return SDKernelsFluxAttnProcessor(processor)


def _native_backend() -> bool:
    """Whether diffusers' dispatch would run its default "native" backend (torch SDPA) when no backend
    is named: none set for the process (``DIFFUSERS_ATTN_BACKEND``, ``attention_backend(...)``)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE


def _norms(attn, text: bool) -> tuple | None:
    """(eps, weights) of ``attn``'s q/k RMSNorms (the text stream's after the image's) where
    ``qk_norm_rope`` computes what they do: all ``torch.nn.RMSNorm`` over the head dim with one eps,
    weights None or [D]; (None, Nones) where all are None (no norm); None where anything else is."""
    modules = [attn.norm_q, attn.norm_k]
    if text:
        modules += [getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None)]
    if all(m is None for m in modules):
        return None, (None,) * 4
    if any(type(m) is not torch.nn.RMSNorm or tuple(m.normalized_shape) != (attn.head_dim,) for m in modules):
        return None
    eps = {m.eps for m in modules}
    if len(eps) != 1 or None in eps:  # eps None: torch's per-dtype default, left to the modules
        return None
    return eps.pop(), (*(m.weight for m in modules), *(None,) * (4 - len(modules)))


def _fused_inputs(attn, query: torch.Tensor, encoder_query: torch.Tensor | None, image_rotary_emb) -> tuple | None:
    """(eps, weights, (cos, sin)) for ``qk_norm_rope`` where it computes the processor's lines from the
    projections to the attention's inputs: the norms ``_norms`` serves, FLUX's rotary embedding (None,
    or a (cos, sin) pair of [S, D] tensors), projections [B, S, H·D] (the text stream's when ``attn``
    has one). None: the processor runs diffusers' lines (which also raise diffusers' errors)."""
    norms = _norms(attn, encoder_query is not None)
    if norms is None or not isinstance(query, torch.Tensor) or query.dim() != 3:
        return None
    if attn.added_kv_proj_dim is not None and (not isinstance(encoder_query, torch.Tensor) or encoder_query.dim() != 3):
        return None
    tokens = query.shape[1] + (0 if encoder_query is None else encoder_query.shape[1])
    if image_rotary_emb is None:
        rotary = (None, None)
    elif (isinstance(image_rotary_emb, (tuple, list)) and len(image_rotary_emb) == 2 and attn.head_dim % 2 == 0
          and all(isinstance(t, torch.Tensor) and tuple(t.shape) == (tokens, attn.head_dim) for t in image_rotary_emb)):
        rotary = tuple(image_rotary_emb)
    else:
        return None
    return norms[0], norms[1], rotary


def _delegated(name: str) -> property:
    """``processor.<name>`` read from and written to the stock processor it replaces."""
    return property(lambda self: getattr(self.original, name),
                    lambda self, value: setattr(self.original, name, value))


class SDKernelsFluxAttnProcessor:
    """diffusers' FluxAttnProcessor with sd_kernels' attention in place of the native backend's SDPA."""

    # What diffusers' set_attention_backend() and enable_parallelism() set on a processor (then its calls
    # go to diffusers' dispatch), kept on the stock processor this one replaces: a choice made while
    # patched stays after unpatch puts it back.
    _attention_backend = _delegated("_attention_backend")
    _parallel_config = _delegated("_parallel_config")
    profile_scoped = True
    # The attention op's; patch(precision="fp8") sets "fp8" on the instance (patches/fp8.py). Under
    # context parallelism (Ulysses' local attention, ring's gathered one: patches/context_parallel.py) exact.
    precision = "exact"
    # Each stream's q, k, v as one GEMM on the buffer the three weights share (patches/qkv_fusion.py);
    # None: diffusers' projections.
    qkv = added_qkv = None

    def __init__(self, original) -> None:
        self.original = original  # the FluxAttnProcessor replaced (unpatch puts it back)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _native(self) -> bool:
        """Whether diffusers' dispatch would run its native backend for this processor: no backend chosen for
        it or for the process (then the attention is ours, where its mask and parallel config allow)."""
        return self._attention_backend is None and _native_backend()

    def _ring(self) -> bool:
        """Whether this call's attention is the ring exchange ``_attention`` would run (gathered keys and
        values, patches/context_parallel.py)."""
        return context_parallel.ring_degree(self._parallel_config) is not None and self._native()

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, kv_stats=None) -> torch.Tensor:
        """diffusers' ``dispatch_attention_fn(query, key, value, attn_mask=attention_mask,
        backend=self._attention_backend, parallel_config=self._parallel_config)`` on [B, S, H, D]; ``kv_stats``:
        the FP8 attention's K/V statistics from ``qk_norm_rope_fp8``, or None."""
        parallel = self._parallel_config
        if attention_mask is None and self._native():
            if parallel is None:
                # diffusers' native backend: SDPA(q, k, v) on the [B, H, S, D] views, the result permuted back
                query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
                return attention(query, key, value, precision=self.precision, kv_stats=kv_stats).permute(0, 2, 1, 3)
            if context_parallel.serves(parallel):  # Ulysses (diffusers' template, our local attention) or ring
                context_parallel.check_heads(query.shape[2], parallel, "FluxAttention")
                return context_parallel.attention(query, key, value, parallel)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )

    # The parameters are diffusers' (FluxAttention.forward passes a processor only the keyword arguments
    # its __call__'s signature names, and warns about the others).
    @scoped
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # called whole, nothing runs beside a ring exchange: the attention takes the keys in parts as they arrive
        return self._begin(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                           in_parts=True)()

    @scoped
    def begin(self, attn, hidden_states: torch.Tensor, image_rotary_emb=None) -> Callable[[], torch.Tensor]:
        """A single-stream block's call ``attn(hidden_states, image_rotary_emb=...)`` in two halves: this
        runs the projections and the attention's inputs and, under ring context parallelism, starts the
        keys' and values' exchange; the call it returns runs the rest and returns the call's result.
        What the caller queues between overlaps the exchange (FLUX's single blocks: their MLP)."""
        return self._begin(attn, hidden_states, None, None, image_rotary_emb)

    def _begin(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, in_parts=False):
        from diffusers.models.embeddings import apply_rotary_emb

        # diffusers: _get_qkv_projections(attn, hidden_states, encoder_hidden_states), one GEMM a stream
        # where the patch laid the three weights out in one buffer
        query, key, value, encoder_query, encoder_key, encoder_value = qkv_fusion.projections(
            self, attn, hidden_states, encoder_hidden_states
        )
        ring = attention_mask is None and self._ring()  # the keys and values go out as one buffer
        text = attn.added_kv_proj_dim is not None
        fused = _fused_inputs(attn, query, encoder_query if text else None, image_rotary_emb)
        kv = kv_stats = None
        if fused is not None:  # the lines below in one op: sd_kernels.ops.qk_norm_rope
            eps, (q_weight, k_weight, eq_weight, ek_weight), (cos, sin) = fused
            stream = dict(eq=encoder_query, ek=encoder_key, ev=encoder_value, eq_weight=eq_weight,
                          ek_weight=ek_weight) if text else {}
            args = (query, key, value, attn.head_dim)
            norm_rope = dict(q_weight=q_weight, k_weight=k_weight, eps=eps, cos=cos, sin=sin, **stream)
            if ring:  # the keys and values written side by side (into the exchange's buffer where it has one)
                shape = kv_shape_of(query, encoder_query if text else None, attn.head_dim)
                out = context_parallel.kv_buffer(shape, query.dtype, query.device, self._parallel_config)
                query, kv = qk_norm_rope_kv(*args, **norm_rope, kv_out=out)
            elif (self.precision == "fp8" and attention_mask is None and self._parallel_config is None
                  and self._native()):
                # the FP8 attention's K/V statistics computed as the keys are written (its pre-pass then skips them)
                query, key, value, kv_stats = qk_norm_rope_fp8(*args, **norm_rope)
            else:
                query, key, value = qk_norm_rope(*args, **norm_rope)
        else:
            query = query.unflatten(-1, (-1, attn.head_dim))
            key = key.unflatten(-1, (-1, attn.head_dim))
            value = value.unflatten(-1, (-1, attn.head_dim))

            query = attn.norm_q(query)
            key = attn.norm_k(key)

            if attn.added_kv_proj_dim is not None:
                encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
                encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
                encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))

                encoder_query = attn.norm_added_q(encoder_query)
                encoder_key = attn.norm_added_k(encoder_key)

                query = torch.cat([encoder_query, query], dim=1)
                key = torch.cat([encoder_key, key], dim=1)
                value = torch.cat([encoder_value, value], dim=1)

            if image_rotary_emb is not None:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
            if ring:
                kv = kv_layout(key, value)

        if ring:
            pending = context_parallel.gather_kv(kv, self._parallel_config)
            return functools.partial(self._finish, attn, query, pending, None, None, encoder_hidden_states, in_parts)
        return functools.partial(self._finish, attn, query, key, value, attention_mask, encoder_hidden_states,
                                 kv_stats=kv_stats)

    @scoped
    def _finish(self, attn, query, key, value, attention_mask, encoder_hidden_states, in_parts=False, kv_stats=None):
        """The call from the attention core on (``value`` None: ``key`` is the ring exchange under way, attended
        in parts as it arrives where ``in_parts``: patches/context_parallel.py)."""
        if value is None:
            hidden_states = context_parallel.attend_gathered(query, key, self._parallel_config, in_parts)
        else:
            # diffusers: dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=...,
            # parallel_config=...)
            hidden_states = self._attention(query, key, value, attention_mask, kv_stats)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())

            return hidden_states, encoder_hidden_states
        else:
            return hidden_states
