"""Stable Diffusion pipelines with random weights, built offline from configs shipped in the package.

No hub access is needed: ``sd_kernels/configs/<name>.json`` holds the UNet (or transformer), VAE,
text encoder(s) and scheduler configs of SD1.5, SD2.1, SDXL, PixArt-Σ, SD3-medium, FLUX.1-dev and five tiny test
models; the tokenizers are generated: CLIP's a byte-level vocabulary with no merges, T5's (PixArt, SD3, FLUX) a Unigram
vocabulary of single printable ASCII characters, with and without the word-start mark; every
character is a token either way. The weights are random, so images are noise-like: good for speed,
memory and fidelity measurements, not for art.

``load_pipeline`` also takes a local directory written by ``save_pretrained`` (or a hub id where
the hub is reachable) for real checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import pathlib
import re
import tempfile
from collections.abc import Callable
from importlib import resources
from typing import Any

import torch

_TEXT_ENCODER_CLASSES = {"text_encoder": "CLIPTextModel", "text_encoder_2": "CLIPTextModelWithProjection",
                         "text_encoder_3": "T5EncoderModel"}
# The diffusers class of each model part; a config's section may name another with a "class" key.
_MODEL_CLASSES = {"unet": "UNet2DConditionModel", "transformer": "PixArtTransformer2DModel", "vae": "AutoencoderKL"}
_PARTS = (*_MODEL_CLASSES, *_TEXT_ENCODER_CLASSES)


def list_configs() -> list[str]:
    files = resources.files("sd_kernels.configs").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def default_model(on_gpu: bool) -> str:
    """The shipped config the commands use without ``--model``: SD1.5 on a GPU, the tiny one on the CPU."""
    return "sd15" if on_gpu else "tiny"


def image_side(name: str, size: int | None = None) -> int:
    """The image side for ``name`` (a shipped config or a path): ``size``, else the config's resolution
    (512 for a path); a ValueError unless it is a multiple of 8 (the VAE's scale factor)."""
    side = size or (load_config(name).get("resolution", 512) if name in list_configs() else 512)
    if side % 8:
        raise ValueError(f"size {side}: the image side must be a multiple of 8 (the VAE's scale factor)")
    return side


def load_config(name: str) -> dict[str, Any]:
    """The shipped config ``name`` (see ``list_configs``) as a dict."""
    known = list_configs()
    if name not in known:
        raise ValueError(f"unknown model config {name!r}; known configs: {', '.join(known)}")
    return json.loads(resources.files("sd_kernels.configs").joinpath(f"{name}.json").read_text())


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (GPT-2's construction)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    order = list(printable)
    for b in range(256):
        if b not in printable:
            order.append(b)
            codes.append(256 + extra)
            extra += 1
    by_byte = dict(zip(order, codes))
    return [chr(by_byte[b]) for b in range(256)]


def write_tokenizer(directory: str | os.PathLike) -> pathlib.Path:
    """Write a minimal CLIP tokenizer (vocab.json, merges.txt, tokenizer_config.json) to ``directory``."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    alphabet = _byte_level_alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(alphabet)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "unk_token": "<|endoftext|>"}
    config = {"model_max_length": 77, "tokenizer_class": "CLIPTokenizer", **special}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@functools.cache
def _written(writer: Callable[[str], pathlib.Path]) -> str:
    """A temporary directory that ``writer`` (write_tokenizer, write_t5_tokenizer) filled, once a process."""
    return str(writer(tempfile.mkdtemp(prefix=f"sd_kernels_{writer.__name__}_")))


def make_tokenizer():
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(_written(write_tokenizer))


T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5's own vocabulary


def write_t5_tokenizer(directory: str | os.PathLike) -> pathlib.Path:
    """Write a minimal T5 tokenizer (tokenizer.json, tokenizer_config.json: no sentencepiece model) to
    ``directory``: T5's specials, then "▁" and each printable ASCII character alone and after "▁"
    (192 tokens, Unigram, no byte fallback: anything else is <unk>); "</s>" ends every sequence."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    vocab = [(t, 0.0) for t in T5_SPECIALS] + [("▁", -2.0)]
    vocab += [("▁" + c, -2.5) for c in chars] + [(c, -3.0) for c in chars]
    tok = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    metaspace = dict(replacement="▁", prepend_scheme="always", split=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(**metaspace)])
    tok.decoder = decoders.Metaspace(**metaspace)
    tok.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                                       special_tokens=[("</s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    pad, eos, unk = T5_SPECIALS
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": 300, "pad_token": pad, "eos_token": eos,
              "unk_token": unk, "extra_ids": 0, "additional_special_tokens": []}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def make_t5_tokenizer():
    from transformers import T5TokenizerFast

    return T5TokenizerFast.from_pretrained(_written(write_t5_tokenizer))


def _text_encoder(kind: str, cfg: dict[str, Any]):
    import transformers

    cfg = dict(cfg)
    cls = cfg.pop("class", _TEXT_ENCODER_CLASSES[kind])
    if cls == "T5EncoderModel":
        return transformers.T5EncoderModel(transformers.T5Config(**cfg))
    # The generated tokenizer's specials; the pooled output is read at the eos position.
    config = transformers.CLIPTextConfig(**cfg, bos_token_id=512, eos_token_id=513, pad_token_id=513)
    return getattr(transformers, cls)(config)


def _tokenizer_for(encoder):
    return make_t5_tokenizer() if type(encoder).__name__ == "T5EncoderModel" else make_tokenizer()


def _scheduler(cfg: dict[str, Any]):
    import diffusers

    cfg = dict(cfg)
    return getattr(diffusers, cfg.pop("class")).from_config(cfg)


def build_model(name: str, part: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """One random-weight part (``unet`` or ``transformer``, ``vae``, ``text_encoder``, ``text_encoder_2``,
    ``text_encoder_3``) of config ``name``.

    ``device="meta"`` builds it without memory, e.g. to count parameters.
    """
    import diffusers

    cfg = load_config(name)
    if part not in cfg or part in ("scheduler", "pipeline"):
        parts = [p for p in cfg if p in _PARTS]
        raise ValueError(f"config {name!r} has no model part {part!r}; parts: {', '.join(parts)}")
    with torch.device(device):
        if part in _MODEL_CLASSES:
            section = dict(cfg[part])
            model = getattr(diffusers, section.pop("class", _MODEL_CLASSES[part])).from_config(section)
        else:
            model = _text_encoder(part, cfg[part])
    if dtype != torch.float32:
        with _quiet_diffusers():  # it warns about keep-in-fp32 modules even when there are none
            model = model.to(dtype=dtype)
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _quiet_diffusers():
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(level)


def build_pipeline(
    name: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A complete diffusers pipeline of config ``name`` with random weights (seeded), fully offline."""
    import diffusers

    cfg = load_config(name)
    torch.manual_seed(seed)
    parts = {p: build_model(name, p, device, dtype) for p in _PARTS if p in cfg}
    parts["scheduler"] = _scheduler(cfg["scheduler"])
    parts["tokenizer"] = _tokenizer_for(parts["text_encoder"])
    for i in (2, 3):  # SDXL's second CLIP; SD3's second CLIP and its T5; FLUX's T5 (its second)
        if f"text_encoder_{i}" in parts:
            parts[f"tokenizer_{i}"] = _tokenizer_for(parts[f"text_encoder_{i}"])
    pipeline_cls = getattr(diffusers, cfg["pipeline"])
    if cfg["pipeline"] == "StableDiffusionPipeline":
        parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return pipeline_cls(**parts)


def build_controlnet_pipeline(
    name: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    controlnets: int = 1,
):
    """``build_pipeline(name)`` with ControlNet: the SD or SDXL ControlNet pipeline, its ControlNet(s)
    made from the shipped UNet config by diffusers' ``ControlNetModel.from_unet`` (random weights,
    offline); ``controlnets > 1`` gives a MultiControlNetModel of that many."""
    import diffusers

    base = build_pipeline(name, device, dtype, seed)
    # The conditioning embedding downsamples the control image to the latents' size: one stride-2 step
    # per factor 2 of the VAE (SD: 8 → diffusers' default (16, 32, 96, 256)).
    steps = (base.vae_scale_factor - 1).bit_length()
    embedding = (16, 32, 96, 256, 256)[: steps + 1]
    nets = []
    for i in range(controlnets):
        torch.manual_seed(seed + 1 + i)
        with _quiet_diffusers():
            net = diffusers.ControlNetModel.from_unet(base.unet, load_weights_from_unet=False,
                                                      conditioning_embedding_out_channels=embedding)
            nets.append(net.to(device=device, dtype=dtype).eval().requires_grad_(False))
    xl = "text_encoder_2" in base.components
    cls = diffusers.StableDiffusionXLControlNetPipeline if xl else diffusers.StableDiffusionControlNetPipeline
    parts = {k: v for k, v in base.components.items() if k in inspect.signature(cls.__init__).parameters}
    parts["controlnet"] = nets[0] if controlnets == 1 else nets
    return cls(**parts)


def load_random_ip_adapters(unet, adapters: int = 1, image_embed_dim: int = 16, seed: int = 0) -> None:
    """Load ``adapters`` random IP-Adapters (the original format: 4 image tokens from one image
    embedding of ``image_embed_dim``) into ``unet`` with diffusers' own loader (offline, no weights):
    ``IPAdapterAttnProcessor2_0`` on every cross-attention, ``encoder_hid_proj`` for the embeddings.
    Call the UNet with ``added_cond_kwargs={"image_embeds": [tensor [B, 1, image_embed_dim]] * adapters}``."""
    cross = unet.config.cross_attention_dim
    names = [k.removesuffix(".processor") for k in unet.attn_processors if not k.endswith("attn1.processor")]
    state_dicts = []
    for a in range(adapters):
        g = torch.Generator().manual_seed(seed + a)

        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g) * 0.3

        image_proj = {"proj.weight": rand(4 * cross, image_embed_dim), "proj.bias": rand(4 * cross),
                      "norm.weight": 1 + rand(cross), "norm.bias": rand(cross)}
        ip = {}
        for j, name in enumerate(names):  # diffusers numbers the cross-attentions 1, 3, 5, ...
            hidden = unet.get_submodule(name).to_q.out_features
            ip[f"{1 + 2 * j}.to_k_ip.weight"] = rand(hidden, cross)
            ip[f"{1 + 2 * j}.to_v_ip.weight"] = rand(hidden, cross)
        state_dicts.append({"image_proj": image_proj, "ip_adapter": ip})
    with _quiet_diffusers():
        unet._load_ip_adapter_weights(state_dicts, low_cpu_mem_usage=False)


def load_pipeline(
    name_or_path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A shipped config name (random weights), a local directory (``save_pretrained`` output) or a
    hub id (needs the hub) → a pipeline on ``device`` in ``dtype``."""
    if name_or_path in list_configs():
        return build_pipeline(name_or_path, device, dtype, seed)
    import diffusers

    local = os.path.isdir(name_or_path)
    hub_id = re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name_or_path) is not None  # "owner/name"
    if not local and not hub_id:
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a shipped config ({', '.join(list_configs())}) nor a directory"
        )
    # Cast after loading: the dtype keyword of from_pretrained changed name across diffusers releases.
    pipe = diffusers.DiffusionPipeline.from_pretrained(name_or_path, local_files_only=local)
    return pipe.to(device=device, dtype=dtype)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
