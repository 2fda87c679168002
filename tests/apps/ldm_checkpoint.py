"""A diffusers SD1.x-layout pipeline written as one original-layout (LDM) ``.safetensors`` file: the
form single-file checkpoints are shared in, which diffusers' ``from_single_file`` reads. For the tests
of single-file loading: the key names follow the original Stable Diffusion code's modules."""

from __future__ import annotations

import re

import torch
from safetensors.torch import save_file

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
           ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"))
_VAE_ATTENTION = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))
_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _rename(rest: str, pairs) -> str:
    for new, old in pairs:
        if rest.startswith(new + "."):
            return old + rest[len(new):]
    return rest


def _unet_key(key: str, per_block: int) -> str:
    for new, old in _UNET_TOP.items():
        if key.startswith(new + "."):
            return old + key[len(new):]
    if m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        slot = 1 + i * (per_block + 1) + j
        return (f"input_blocks.{slot}.0.{_rename(rest, _RESNET)}" if kind == "resnets"
                else f"input_blocks.{slot}.1.{rest}")
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
        return f"input_blocks.{(int(m[1]) + 1) * (per_block + 1)}.0.op.{m[2]}"
    if m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", key):
        return f"middle_block.{2 * int(m[1])}.{_rename(m[2], _RESNET)}"
    if m := re.match(r"mid_block\.attentions\.0\.(.*)", key):
        return f"middle_block.1.{m[1]}"
    if m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        slot = i * (per_block + 1) + j
        return (f"output_blocks.{slot}.0.{_rename(rest, _RESNET)}" if kind == "resnets"
                else f"output_blocks.{slot}.1.{rest}")
    raise KeyError(key)


def _unet(unet) -> dict[str, torch.Tensor]:
    cfg = unet.config
    per_block = cfg.layers_per_block
    out = {}
    for key, value in unet.state_dict().items():
        if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key):
            i = int(m[1])
            slot = i * (per_block + 1) + per_block
            has_attention = "CrossAttn" in cfg.up_block_types[i]
            name = f"output_blocks.{slot}.{2 if has_attention else 1}.conv.{m[2]}"
        else:
            name = _unet_key(key, per_block)
        out["model.diffusion_model." + name] = value
    return out


def _vae(vae) -> dict[str, torch.Tensor]:
    blocks = len(vae.config.block_out_channels)
    out = {}
    for key, value in vae.state_dict().items():
        name = key.replace("conv_norm_out", "norm_out")
        if m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", key):
            name = f"{m[1]}.mid.attn_1.{_rename(m[2], _VAE_ATTENTION)}"
            value = value[:, :, None, None] if value.ndim == 2 else value  # 1x1 convolutions in the original
        elif m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", key):
            name = f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(.*)", key):
            name = f"encoder.down.{m[1]}.block.{m[2].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)", key):
            name = f"encoder.down.{m[1]}.downsample.{m[2]}"
        elif m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(.*)", key):
            name = f"decoder.up.{blocks - 1 - int(m[1])}.block.{m[2].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
            name = f"decoder.up.{blocks - 1 - int(m[1])}.upsample.{m[2]}"
        out["first_stage_model." + name] = value
    return out


def save_ldm_checkpoint(pipe, path) -> None:
    """Write ``pipe`` (a StableDiffusionPipeline) as one original-layout safetensors file."""
    tensors = {**_unet(pipe.unet), **_vae(pipe.vae)}
    for key, value in pipe.text_encoder.state_dict().items():
        # the original layout's names: transformers 4's, under text_model
        name = key if key.startswith("text_model.") else "text_model." + key
        tensors["cond_stage_model.transformer." + name] = value
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
