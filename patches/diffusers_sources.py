"""Which diffusers code our copies mirror: the source hashes of the diffusers functions that patchers
re-state (a processor's ``__call__``, a block's ``forward``), as read from diffusers 0.42.1; and of the
transformers T5 forwards that patches/t5_encoder.py re-states, as read from the transformers versions
``TRANSFORMERS_VERIFIED_WITH`` names.

A patcher that replaces such a function with our version of it first checks that the installed
diffusers has the very source it was written against; under another version it leaves the function
alone and says so in the record (``record.skip``), so a changed upstream forward is never replaced by
a stale copy.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable

# sha256 (first 16 hex digits) of inspect.getsource(...) in diffusers 0.42.1
VERIFIED = {
    "ResnetBlock2D.forward": "e3f38e1722955caf",
    "AttnProcessor2_0.__call__": "bf23ea5ae4040427",
    "AttnProcessor.__call__": "96f0b283a09a7b37",
    "FusedAttnProcessor2_0.__call__": "dd31131145952459",
    "IPAdapterAttnProcessor2_0.__call__": "3626f6de5fcd6280",
    "JointAttnProcessor2_0.__call__": "392b6bf56c8505d1",
    "FusedJointAttnProcessor2_0.__call__": "38ab0a3e81c938e3",
    "FluxAttnProcessor.__call__": "d5b36134887ebe45",
    "JointTransformerBlock.forward": "9dd8f9decdd27284",
    "FluxTransformerBlock.forward": "0b184cbe172708b6",
    "FluxSingleTransformerBlock.forward": "57350a6dab842b40",
    "AdaLayerNormZero.forward": "93374820c014f812",
    "AdaLayerNormZeroSingle.forward": "d48dfb2b1e75e64f",
    "FeedForward.forward": "dae2c9f53987c25a",
    "Transformer2DModel._get_output_for_continuous_inputs": "4787ea4f43c55009",
    "BasicTransformerBlock.forward": "440071576ac5ee6f",
    "StableDiffusionPipeline.__call__": "35adac16365e855f",
    "StableDiffusionXLPipeline.__call__": "4d58fbfc599e50c2",
    "DiffusionPipeline._execution_device": "f743b5e9ec1d2991",
    "_get_top_level_group_offload_hook": "a58e642ddca09c94",
    "_get_group_onload_device": "c93f14298ad1228a",
    "DiffusionPipeline.device": "200dc9da61997fda",
    "ModelMixin.device": "7fd5bd482c58953b",
    "get_parameter_device": "2512d13c2214e520",
    "UniPCMultistepScheduler.multistep_uni_p_bh_update": "287c57208dceb062",
    "UniPCMultistepScheduler.multistep_uni_c_bh_update": "0527122ebb9676aa",
    "UniPCMultistepScheduler._sigma_to_alpha_sigma_t": "3c6872414f3ab42b",
    "Decoder.forward": "be96bf1aec1d895a",
    "UpDecoderBlock2D.forward": "a4a83c23b787086a",
    "UNetMidBlock2D.forward": "4e74348d59aa87c1",
    "Upsample2D.forward": "3c0e13df5e4ac796",
    "PixArtSigmaPipeline.encode_prompt": "720b88e8b5a3892a",
    "PixArtAlphaPipeline.encode_prompt": "dca0bf45d71bad9f",
    "PixArtTransformer2DModel.forward": "7d77c5dc2fc3cc2c",
    # called, not re-stated: the context-parallel templates and the native ops whose convention
    # patches/context_parallel.py follows
    "_templated_context_parallel_attention": "ae2c32276d93f634",
    "TemplatedUlyssesAttention.forward": "40c9564ba700707e",
    "TemplatedUlyssesAnythingAttention.forward": "f94150ab0a7439d7",
    "_native_attention_forward_op": "e04b48e37940bf44",
    "_native_attention_backward_op": "ad6f75491445a094",
}
VERIFIED_WITH = "0.42.1"

# sha256 (first 16 hex digits) of inspect.getsource(...) in transformers 5.17.0 and 5.24.0: one hash where
# both versions have the same source
TRANSFORMERS_VERIFIED = {
    "T5LayerNorm.forward": ("dfa1fc9512845898",),
    "T5DenseGatedActDense.forward": ("3f5c41a204c168ae",),
    "T5Attention.forward": ("44f188bfdffb355a", "a57bc3ed209bb7a8"),  # 5.17.0, 5.24.0 (its cache argument renamed)
}
TRANSFORMERS_VERIFIED_WITH = ("5.17.0", "5.24.0")


@functools.cache
def is_verified(fn: Callable) -> bool:
    """True if ``fn``'s source is one ``VERIFIED`` or ``TRANSFORMERS_VERIFIED`` names for its qualified name."""
    name = fn.__qualname__
    wants = (VERIFIED[name],) if name in VERIFIED else TRANSFORMERS_VERIFIED.get(name, ())
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest()[:16] in wants
