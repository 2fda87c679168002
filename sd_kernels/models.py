"""Stable Diffusion pipelines with random weights, built offline from configs shipped in the package.

No hub access is needed: ``sd_kernels/configs/<name>.json`` holds the UNet (or transformer), VAE,
text encoder(s) and scheduler configs of SD1.5, SD2.1, SDXL, PixArt-Σ, SD3-medium, FLUX.1-dev and five tiny test
models; the tokenizers are generated: CLIP's a byte-level vocabulary with no merges, T5's (PixArt, SD3, FLUX) a Unigram
vocabulary of single printable ASCII characters, with and without the word-start mark; every
character is a token either way. The weights are random, so images are noise-like: good for speed,
memory and fidelity measurements, not for art.

``load_pipeline`` also takes real checkpoints: a single-file ``.safetensors`` (SD1.x, SD2.x, SDXL;
loaded offline with the architecture's config from this package, or from a diffusers folder given as
``config``), a local directory written by ``save_pretrained``, or a hub id where the hub is reachable.
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


def image_side(name: str, size: int | None = None, option: str = "size") -> int:
    """The image side for ``name`` (see ``model_facts``): ``size``, else the model's own (its width); a
    ValueError naming ``option`` (the command line's ``--size``) unless it is a positive multiple of 8 (the VAE's
    scale factor)."""
    side = model_facts(name)["size"][0] if size is None else size
    if side <= 0 or side % 8:
        raise ValueError(f"{option} {side}: the image side must be a positive multiple of 8 (the VAE's scale factor)")
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


def load_random_ip_adapters(model, adapters: int = 1, image_embed_dim: int = 16, seed: int = 0) -> None:
    """Load ``adapters`` random IP-Adapters (the original format: 4 image tokens from one image
    embedding of ``image_embed_dim``) into a UNet or a FLUX transformer with diffusers' own loader (offline, no
    weights): ``IPAdapterAttnProcessor2_0`` on every cross-attention of a UNet, ``FluxIPAdapterAttnProcessor`` on
    every double block of FLUX; ``encoder_hid_proj`` for the embeddings. Call a UNet with
    ``added_cond_kwargs={"image_embeds": [tensor [B, 1, image_embed_dim]] * adapters}``, FLUX with
    ``joint_attention_kwargs={"ip_adapter_image_embeds": [the same]}``."""
    flux = hasattr(model, "single_transformer_blocks")
    cross = model.config.joint_attention_dim if flux else model.config.cross_attention_dim
    if flux:  # diffusers numbers FLUX's double blocks 0, 1, 2, ...
        names = [(f"{j}", model.inner_dim) for j in range(len(model.transformer_blocks))]
    else:  # and a UNet's cross-attentions 1, 3, 5, ...
        names = [(f"{1 + 2 * j}", model.get_submodule(k.removesuffix(".processor")).to_q.out_features)
                 for j, k in enumerate(k for k in model.attn_processors if not k.endswith("attn1.processor"))]
    state_dicts = []
    for a in range(adapters):
        g = torch.Generator().manual_seed(seed + a)

        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g) * 0.3

        image_proj = {"proj.weight": rand(4 * cross, image_embed_dim), "proj.bias": rand(4 * cross),
                      "norm.weight": 1 + rand(cross), "norm.bias": rand(cross)}
        ip = {}
        for key, hidden in names:
            for kind in ("k", "v"):
                ip[f"{key}.to_{kind}_ip.weight"] = rand(hidden, cross)
                if flux:
                    ip[f"{key}.to_{kind}_ip.bias"] = rand(hidden)
        state_dicts.append({"image_proj": image_proj, "ip_adapter": ip})
    with _quiet_diffusers():
        model._load_ip_adapter_weights(state_dicts, low_cpu_mem_usage=False)


def load_pipeline(
    name_or_path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config: str | None = None,
):
    """A shipped config name (random weights), a single-file ``.safetensors`` checkpoint, a local
    directory (``save_pretrained`` output) or a hub id (needs the hub) → a pipeline on ``device`` in
    ``dtype``. Weights load in ``dtype`` (a folder's ``fp16``/``bf16`` variant where it has one for
    ``dtype``). ``config``: a single file's architecture (see ``checkpoint_config``)."""
    if name_or_path in list_configs():
        return build_pipeline(name_or_path, device, dtype, seed)
    import diffusers

    if is_single_file(name_or_path):
        return _load_single_file(name_or_path, config, dtype).to(device=device)
    local = os.path.isdir(name_or_path)
    if not local and not is_hub_id(name_or_path):
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a shipped config ({', '.join(list_configs())}), a .safetensors "
            "checkpoint nor a directory"
        )
    variant = _variant(name_or_path, dtype) if local else None
    pipe = diffusers.DiffusionPipeline.from_pretrained(name_or_path, local_files_only=local, dtype=dtype,
                                                       variant=variant)
    return pipe.to(device=device)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a hub id ("owner/name") and is no local path."""
    return not os.path.exists(name) and re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name) is not None


def _local_reading(name: str) -> str:
    """For an error about hub id ``name``: that it may be a mistyped local folder, where its first part is a
    folder here (``models/my-sdxl`` with a ``models/`` folder), else nothing."""
    owner = name.split("/")[0]
    return f" (nor is there a local folder {name}, though {owner}/ is here)" if os.path.isdir(owner) else ""


def is_single_file(name: str) -> bool:
    """Whether ``name`` is a single-file checkpoint (``.safetensors``) on this machine."""
    return name.lower().endswith(".safetensors") and os.path.isfile(name)


_VARIANTS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _variant(folder: str, dtype: torch.dtype) -> str | None:
    """The weight variant of ``folder`` stored in ``dtype`` (``*.fp16.safetensors``), if it has one."""
    name = _VARIANTS.get(dtype)
    if name is None:
        return None
    found = any(any(pathlib.Path(folder).glob(f"*/*.{name}.{ext}")) for ext in ("safetensors", "bin"))
    return name if found else None


# ---------------------------------------------------------------------------------------------------------
# Single-file checkpoints and what a model is before it is built

# diffusers' name for a single file's architecture (loaders.single_file_utils.infer_diffusers_model_type)
# → the shipped config with that architecture.
_SINGLE_FILE_ARCHITECTURES = {"v1": "sd15", "v2": "sd21", "xl_base": "sdxl"}
_UNET_PREFIX = "model.diffusion_model."  # the denoiser's keys in an SD, SD2 or SDXL single-file checkpoint
_SINGLE_FILE_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")
# The shipped SD configs have CLIP's 49,408-token vocabulary, which the generated tokenizer does not
# hold: a real checkpoint of them needs the real tokenizer, found in the Hugging Face cache here.
_CLIP_VOCAB = 49408
_TOKENIZER_REPOS = {"sd15": "stable-diffusion-v1-5/stable-diffusion-v1-5", "sd21": "stabilityai/stable-diffusion-2-1",
                    "sdxl": "stabilityai/stable-diffusion-xl-base-1.0"}


def checkpoint_config(path: str, config: str | None = None) -> str:
    """The architecture of the single-file checkpoint ``path``: ``config`` (a shipped config or a local
    diffusers folder of the same model), else the shipped config of the architecture diffusers infers
    from the checkpoint's tensor names and shapes (SD1.x, SD2.x, SDXL base; read from the file's header,
    no weights loaded). A ValueError naming --config where neither gives one."""
    if config is not None:
        if os.path.isdir(config):
            if not os.path.isfile(os.path.join(config, "model_index.json")):
                raise ValueError(f"--config {config}: not a diffusers pipeline folder (no model_index.json)")
            return config
        if config not in list_configs():
            raise ValueError(f"--config {config!r}: neither a shipped config ({', '.join(list_configs())}) nor a "
                             "diffusers pipeline folder")
        if load_config(config)["pipeline"] not in _SINGLE_FILE_PIPELINES:
            raise ValueError(f"--config {config}: single-file checkpoints load as {' or '.join(_SINGLE_FILE_PIPELINES)}"
                             f"; {config} is a {load_config(config)['pipeline']}")
        return config
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            shapes = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ValueError(f"--model {path}: cannot read it as safetensors ({type(exc).__name__}: {exc})") from None
    kind = infer_diffusers_model_type(shapes)
    if not any(k.startswith(_UNET_PREFIX) for k in shapes):  # diffusers names any unknown file "v1"
        raise ValueError(f"--model {path}: no denoiser weights in it ({_UNET_PREFIX}*): not a Stable Diffusion "
                         "checkpoint (a LoRA goes to --lora)")
    if kind not in _SINGLE_FILE_ARCHITECTURES:
        raise ValueError(f"--model {path}: a {kind!r} checkpoint (diffusers' name for it); give --config, a diffusers "
                         "folder of the same model (its configs and tokenizers are used)")
    return _SINGLE_FILE_ARCHITECTURES[kind]


def _tokenizer_folders(name: str) -> dict[str, str]:
    """For a shipped config with CLIP's vocabulary: its tokenizer folders in the Hugging Face cache
    (tokenizer, and tokenizer_2 for SDXL); a ValueError saying how to provide them where they are not."""
    cfg = load_config(name)
    parts = [p for p in ("text_encoder", "text_encoder_2") if p in cfg]
    if all(cfg[p].get("vocab_size", 0) < _CLIP_VOCAB for p in parts):
        return {}  # a tiny config: the generated tokenizer is its own
    from huggingface_hub import try_to_load_from_cache

    folders = {}
    for part in parts:
        tok = part.replace("text_encoder", "tokenizer")
        found = try_to_load_from_cache(_TOKENIZER_REPOS[name], f"{tok}/vocab.json")
        if not isinstance(found, str):
            raise ValueError(
                f"a {name} single-file checkpoint needs its CLIP tokenizer, which the shipped configs do not hold and "
                f"the Hugging Face cache does not have ({_TOKENIZER_REPOS[name]}, {tok}/). Give --config DIR, a "
                f"diffusers folder of the model (configs and tokenizers, no weights needed), or fetch the "
                f"tokenizer once: hf download {_TOKENIZER_REPOS[name]} --include '{tok}/*'")
        folders[tok] = os.path.dirname(found)
    return folders


def check_single_file(path: str, config: str | None = None) -> str:
    """Everything a single-file load needs, checked before it: the architecture (``checkpoint_config``)
    and, for a shipped one, its tokenizers. Returns the architecture."""
    arch = checkpoint_config(path, config)
    if arch in list_configs():
        _tokenizer_folders(arch)
    return arch


def write_config_folder(name: str, directory: str | os.PathLike) -> pathlib.Path:
    """The diffusers pipeline folder of shipped config ``name`` without weights (model_index.json, each
    part's config, the scheduler's, the tokenizers): what ``from_single_file(config=...)`` reads offline."""
    out = pathlib.Path(directory)
    tokenizers = _tokenizer_folders(name)
    pipe = build_pipeline(name, device="meta")
    pipe.save_config(out)
    for part, component in pipe.components.items():
        if component is None or isinstance(component, bool):
            continue
        if part in tokenizers:  # the cache's files (links to its blobs), copied
            (out / part).mkdir(parents=True, exist_ok=True)
            for src in pathlib.Path(tokenizers[part]).iterdir():
                if src.is_file():
                    (out / part / src.name).write_bytes(src.read_bytes())
        elif hasattr(component, "save_config"):  # diffusers models and schedulers
            component.save_config(out / part)
        elif hasattr(component, "save_pretrained") and not hasattr(component, "state_dict"):  # tokenizers
            component.save_pretrained(out / part)
        else:  # transformers models
            component.config.save_pretrained(out / part)
    return out


def _load_single_file(path: str, config: str | None, dtype: torch.dtype):
    import diffusers

    arch = check_single_file(path, config)
    with tempfile.TemporaryDirectory(prefix="sd_kernels_config_") as tmp:
        folder = arch if os.path.isdir(arch) else str(write_config_folder(arch, tmp))
        with open(os.path.join(folder, "model_index.json")) as f:
            cls = json.load(f)["_class_name"]
        if cls not in _SINGLE_FILE_PIPELINES:
            raise ValueError(f"--config {config}: single-file checkpoints load as "
                             f"{' or '.join(_SINGLE_FILE_PIPELINES)}; this folder holds a {cls}")
        from diffusers.loaders.single_file_utils import SingleFileComponentError

        try:
            return getattr(diffusers, cls).from_single_file(path, config=folder, dtype=dtype, local_files_only=True)
        except SingleFileComponentError as exc:  # weights that do not fit the architecture's parts
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--model {path}: its weights do not load as a {cls} ({first})") from None


def model_facts(name_or_path: str, config: str | None = None) -> dict[str, Any]:
    """What a model is, read from configs without building it: ``pipeline`` (the diffusers class name),
    ``scheduler`` (its class name), ``scheduler_config``, ``size`` ((width, height) it was trained at:
    diffusers' default). For a shipped config, a single file (its ``config``, see ``checkpoint_config``),
    a local folder, or a hub id (its config files, fetched)."""
    if name_or_path in list_configs():
        cfg = load_config(name_or_path)
        sched = dict(cfg["scheduler"])
        side = cfg.get("resolution", 512)
        return {"pipeline": cfg["pipeline"], "scheduler": sched.pop("class"), "scheduler_config": sched,
                "size": (side, side)}
    if is_single_file(name_or_path):
        return model_facts(check_single_file(name_or_path, config))
    if os.path.isdir(name_or_path):
        def read(file: str) -> dict[str, Any]:
            with open(os.path.join(name_or_path, file)) as f:
                return json.load(f)
    elif is_hub_id(name_or_path):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import LocalEntryNotFoundError

        def read(file: str) -> dict[str, Any]:
            try:
                found = hf_hub_download(name_or_path, file)
            except LocalEntryNotFoundError as exc:  # no hub and not cached: not a missing file of the model
                raise OSError(f"{exc}{_local_reading(name_or_path)}") from None
            except OSError as exc:  # an unreachable hub, a missing repo: say so where a local folder was meant
                if not (note := _local_reading(name_or_path)):
                    raise
                raise OSError(f"{exc}{note}") from None
            with open(found) as f:
                return json.load(f)
    else:
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a shipped config ({', '.join(list_configs())}), a .safetensors "
            "checkpoint nor a directory"
        )
    try:  # an unreachable hub is an OSError of its own, reported as it is
        index = read("model_index.json")
        denoiser = "unet" if "unet" in index else "transformer"
        sample = read(f"{denoiser}/config.json").get("sample_size") or 128  # the DiT pipelines' default
        factor = 2 ** (len(read("vae/config.json")["block_out_channels"]) - 1)
        sched = read("scheduler/scheduler_config.json")
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise ValueError(f"{name_or_path}: not a diffusers pipeline with a denoiser, a VAE and a scheduler "
                         f"({type(exc).__name__}: {exc})") from None
    height, width = (sample, sample) if isinstance(sample, int) else sample
    return {"pipeline": index["_class_name"], "scheduler": index["scheduler"][1],
            "scheduler_config": {k: v for k, v in sched.items() if not k.startswith("_")},
            "size": (width * factor, height * factor)}


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
