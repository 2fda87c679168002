"""IP-Adapter's attention on sd_kernels' attention: ``SDKernelsIPAdapterProcessor``.

diffusers' ``IPAdapterAttnProcessor2_0`` (0.42.1) runs the text cross-attention and then, for each
loaded IP-Adapter, an attention of the same queries over that adapter's image tokens, projected by
its ``to_k_ip`` / ``to_v_ip`` and added with the adapter's ``scale``: 1 + N SDPA calls per module.
This processor makes all of them with sd_kernels' attention (patches/attention_processor_steps.py), in the
same order and arithmetic.

The patch does not replace the processor object, it changes its class to this subclass of
``IPAdapterAttnProcessor2_0`` (``PatchRecord.set_class``; unpatch changes it back). So everything a
user does with the processor while patched acts on the one object and survives ``unpatch``:
``set_ip_adapter_scale`` (which looks for ``IPAdapterAttnProcessor2_0`` instances), LoRA on the
image projections, ``load_state_dict``; the state-dict keys stay those of diffusers. Calls this
processor does not mirror go to diffusers' own ``__call__``, errors included: ``ip_adapter_masks``,
per-image scale lists (InstantStyle-like), and the deprecated single-tensor ``encoder_hidden_states``.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

from sd_kernels.profiles import scoped

from . import attention_processor_steps as steps


class SDKernelsIPAdapterProcessor(IPAdapterAttnProcessor2_0):
    """IPAdapterAttnProcessor2_0 with sd_kernels' attention (set as a processor's class by the patch)."""

    profile_scoped = True

    @scoped
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: tuple | torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        scale: float = 1.0,
        ip_adapter_masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (ip_adapter_masks is not None or not isinstance(encoder_hidden_states, tuple)
                or any(isinstance(s, list) for s in self.scale)):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb, scale,
                                    ip_adapter_masks)
        encoder_hidden_states, ip_hidden_states = encoder_hidden_states
        hidden_states, attention_mask, residual, shape, batch = steps.prepare(
            attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        query = attn.to_q(hidden_states)
        source = steps.context(attn, hidden_states, encoder_hidden_states)
        key, value = attn.to_k(source), attn.to_v(source)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (steps.heads(t, batch, attn.heads, head_dim) for t in (query, key, value))
        hidden_states = steps.attend(attn, query, key, value, attention_mask, legacy=False)
        for image, weight, to_k_ip, to_v_ip in zip(ip_hidden_states, self.scale, self.to_k_ip, self.to_v_ip):
            if weight == 0:
                continue
            ip_key, ip_value = (steps.heads(proj(image), batch, attn.heads, head_dim) for proj in (to_k_ip, to_v_ip))
            hidden_states = hidden_states + weight * steps.attend(attn, query, ip_key, ip_value, None, legacy=False)
        return steps.finish(attn, hidden_states, residual, shape)
