"""Context-parallel plans for SD3 and PixArt-Σ, and ``enable_context_parallel``: one image's tokens over
the processes, with sd_kernels' attention exchanging them (Ulysses).

diffusers 0.42.1's context parallelism splits a transformer's token sequence by a plan (the model's
``_cp_plan``, or ``enable_parallelism(config, cp_plan=...)``): hooks that take each process's chunk of
named inputs or outputs, and gather at the end. It ships plans for FLUX and others, none for
``SD3Transformer2DModel`` or ``PixArtTransformer2DModel``. Both get the same plan here (``plan_for``), in
diffusers' format: the output of ``pos_embed`` (the patchified image, [B, N, C], positions added) split
along the tokens, ``proj_out``'s output gathered along them. The text stays whole on every process:
SD3's 333 text tokens (77 CLIP + 256 T5; any prompt length) divide by no process count, and PixArt's
cross-attention needs the whole text anyway. Every token-wise layer then runs on 1/W of the image
tokens (SD3's text stream, 333 tokens, on every process alike).

Attention is where tokens meet, and where the split needs an exchange (``Ulysses.attention``, on
torch.distributed's functional collectives over diffusers' Ulysses mesh): q, k and v of the image
tokens go by all-to-all from [the process's tokens, all heads] to [all tokens, the process's 1/W of the
heads]; the text's q, k and v (SD3's joint attention) are on every process already, and each takes
its heads' slice; the local attention (sd_kernels' ``attention`` op) runs on [all image tokens, the
text]; the image part of the output goes back by all-to-all, the text part (every process needs all
of it for ``to_add_out``) by an all-gather over the heads. PixArt's self-attention is the image-only
case; its cross-attention needs nothing: the process's queries against the whole text.

Why a function and not ``_cp_plan`` on diffusers' classes: diffusers' own SD3 and PixArt processors
call SDPA on whatever tokens they hold, so under the plan they would attend over a process's tokens
only, a silently wrong image. ``enable_context_parallel`` calls diffusers' ``enable_parallelism`` with
the plan, marks each attention module that needs the exchange (``_sd_kernels_ulysses``: what
sd_kernels' processors read, whether the patch came before or after) and registers a check on the
transformer's forward (a diffusers hook, like the plan's): every call, each of those modules runs a
processor of sd_kernels' that exchanges (``exchanges_tokens``), and the image's tokens divide by the
degree; at the first call of each argument signature, every process's tensor arguments agree (float64
sums: a seed per process would put tokens of different noises side by side); else a clear error before
any work. Like ``enable_parallelism``, it cannot be undone; ``unpatch``
gives the stock processors back, and the check then refuses to run them. FLUX goes to diffusers' own
plan and template (patches/context_parallel.py), with the same check of the processes' arguments.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from diffusers.hooks import HookRegistry, ModelHook

from sd_kernels.ops.custom_ops import attention as sdk_attention

from . import cfg_parallel, context_parallel, flux_attention, modulation_split
from .cfg_parallel import close, group_or_error
from .cuda_graph import context_parallel as under_context_parallel

MARK = "_sd_kernels_ulysses"  # on each attention module that exchanges its tokens: its Ulysses
PLANNED = ("SD3Transformer2DModel", "PixArtTransformer2DModel")
_GUARD = "sd_kernels_context_parallel_check"


def plan_for(model) -> dict | None:
    """sd_kernels' context-parallel plan for ``model`` or its class (SD3, PixArt-Σ), in diffusers' format;
    None for others."""
    if (model if isinstance(model, type) else type(model)).__name__ not in PLANNED:
        return None
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class Ulysses:
    """The exchange of one transformer under context parallelism: the Ulysses group, its size, this
    process's rank in it (decided at ``enable_context_parallel``: nothing to ask while torch.compile traces)."""

    group: dist.ProcessGroup
    degree: int
    rank: int

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """[W, ...] contiguous: chunk j goes to process j, and chunk j of the result came from it."""
        return context_parallel.waited(funcol.all_to_all_single(x.flatten(), None, None, self.group)).view(x.shape)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, n, D] (this process's n tokens, all heads) -> [B, H/W, W·n, D] (every process's tokens in
        rank order, the sequence's own order, for this process's heads)."""
        b, h, n, d = x.shape
        x = self._all_to_all(x.reshape(b, self.degree, h // self.degree, n, d).transpose(0, 1).contiguous())
        return x.permute(1, 2, 0, 3, 4).reshape(b, h // self.degree, self.degree * n, d)

    def _to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``_to_heads`` backwards, laid out [B, n, H, D]."""
        b, local, s, d = x.shape
        n = s // self.degree
        x = self._all_to_all(x.view(b, local, self.degree, n, d).permute(2, 0, 3, 1, 4).contiguous())
        return x.permute(1, 2, 0, 3, 4).reshape(b, n, local * self.degree, d)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: int,
                  **kwargs) -> torch.Tensor:
        """The attention of [B, H, S, D] q, k, v whose first ``split`` tokens are this process's share of
        the image tokens and the rest (SD3's text) whole on every process; the output as [B, H, S, D]
        (heads inner in memory). ``kwargs``: the attention op's (scale, upcast), exact precision."""
        heads = query.shape[1]
        own = slice(self.rank * heads // self.degree, (self.rank + 1) * heads // self.degree)
        q, k, v = (torch.cat([self._to_heads(x[:, :, :split]), x[:, own, split:]], dim=2)
                   for x in (query, key, value))
        out = sdk_attention(q, k, v, **kwargs)
        image = self._to_tokens(out[:, :, : self.degree * split])
        text = out[:, :, self.degree * split:]
        if text.shape[2]:
            text = text.transpose(1, 2).contiguous()
            text = context_parallel.waited(context_parallel.all_gather(text, 2, self.group))
            image = torch.cat([image, text], dim=1)
        return image.transpose(1, 2)


def ulysses_of(attn) -> Ulysses | None:
    """The exchange an attention module's processor (one of sd_kernels') runs (None: the module's tokens are
    all here); a clear error where diffusers' ``enable_parallelism`` split the tokens (it sets its config
    on the processor) and ``enable_context_parallel`` marked nothing."""
    ulysses = vars(attn).get(MARK)
    if ulysses is None and under_context_parallel(attn.processor):
        raise ValueError(f"{type(attn.processor).__name__}: this attention's tokens are split over processes by "
                         "diffusers' enable_parallelism alone, and it would attend over a process's share only (a "
                         "wrong image): split SD3 and PixArt-Σ with sd_kernels.enable_context_parallel(pipe)")
    return ulysses


def check_split(models: list[tuple[str, torch.nn.Module]]) -> None:
    """Before a patch: an SD3 or PixArt-Σ under context parallelism is split by ``enable_context_parallel``
    (diffusers' ``enable_parallelism`` with this plan alone marks no attention for the exchange)."""
    for part, m in models:
        if under_context_parallel(m) and plan_for(m) is not None and not any(MARK in vars(a) for a in m.modules()):
            raise ValueError(f"the {part} ({type(m).__name__}) is under context parallelism without sd_kernels' "
                             "exchange (diffusers' enable_parallelism alone): each attention would run over a "
                             "process's share of the tokens (a wrong image); split it with "
                             "sd_kernels.enable_context_parallel(pipe) instead")


def _exchanging(model) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules whose keys come from the split tokens: SD3's joint (and SD3.5's second,
    image-only) attentions, PixArt's self-attentions; not PixArt's cross-attentions (the text's keys)."""
    from diffusers.models.attention_processor import Attention

    return [(path, m) for path, m in model.named_modules() if isinstance(m, Attention) and not m.is_cross_attention]


class _Agree(ModelHook):
    """Before a transformer's call under context parallelism (any plan), at the first call of each argument
    signature: the processes' inputs agree."""

    def __init__(self) -> None:
        super().__init__()
        self.agreed: set = set()  # the argument signatures whose inputs the processes were seen to agree on

    def pre_forward(self, module, *args, **kwargs):
        self._agree(module, args, kwargs)
        return args, kwargs

    def _agree(self, module, args: tuple, kwargs: dict) -> None:
        """Every process holds the same tensor arguments (float64 sums; a collective): each splits the same
        image, and a seed per process would put tokens of different noises side by side, a wrong image."""
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        named = [(params[k] if isinstance(k, int) and k < len(params) else str(k), v)
                 for k, v in [*enumerate(args), *kwargs.items()] if isinstance(v, torch.Tensor)]
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in named)
        if key in self.agreed:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [(k, tuple(v.shape), float(v.detach().sum(dtype=torch.float64)))
                                          for k, v in named])
        differ = ([] if any(len(g) != len(named) for g in gathered) else
                  [k for i, (k, _) in enumerate(named) if any(g[i][:2] != gathered[0][i][:2] for g in gathered)
                   or not close([g[i][2] for g in gathered], [gathered[0][i][2]] * len(gathered))])
        if differ or any(len(g) != len(named) for g in gathered):
            raise ValueError(f"{type(module).__name__} under context parallelism: the processes call it with different "
                             f"{', '.join(differ) or 'arguments'}: every process must run the same pipeline call (same "
                             "prompt, seed or generator, size and settings); only the image's tokens are split")
        self.agreed.add(key)


class _Check(_Agree):
    """Before each call of a transformer under sd_kernels' plan: the processors exchange, the tokens divide;
    at the first call of each argument signature, the processes' inputs agree."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], degree: int) -> None:
        super().__init__()
        self.modules, self.degree = modules, degree

    def pre_forward(self, module, *args, **kwargs):
        name = type(module).__name__
        for path, attn in self.modules:
            if not getattr(attn.processor, "exchanges_tokens", False):
                raise ValueError(
                    f"{name} under context parallelism holds 1/{self.degree} of the image tokens on each process, and "
                    f"{path} has {type(attn.processor).__name__}, which would attend over those only (a wrong "
                    "image): sd_kernels.patch(pipe) gives it sd_kernels' attention, which exchanges the tokens "
                    "(before or after enable_context_parallel; docs/parallel.md)")
        if kwargs.get("block_controlnet_hidden_states") is not None:
            raise ValueError(f"{name} under context parallelism: ControlNet residuals are not served (whole-sequence "
                             "tensors, added to a process's share of the tokens); run the ControlNet pipeline on one "
                             "process, or its guidance batch over 2 with patch(pipe, parallel='cfg')")
        latent = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        p = module.config.patch_size
        rows, cols = latent.shape[-2] // p, latent.shape[-1] // p
        if rows * cols % self.degree:
            raise ValueError(f"{name} under context parallelism splits the image's {rows}×{cols} = {rows * cols} "
                             f"tokens ({p}×{p} patches of a {latent.shape[-2]}×{latent.shape[-1]} latent) over "
                             f"{self.degree} processes, which do not divide them: choose a height and width whose "
                             f"patch grid has a multiple of {self.degree} tokens")
        self._agree(module, args, kwargs)
        return args, kwargs


def _same_processors(modules: list[tuple[str, torch.nn.Module]], name: str) -> None:
    """Raise on every process unless all of them hold the same attention processors (a collective): a
    patch made before ``enable_context_parallel`` on some processes only would have those exchange
    and wait forever for the others, which refuse to run diffusers' processors under the split."""
    mine = [type(attn.processor).__name__ for _, attn in modules]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if any(g != gathered[0] for g in gathered):
        i = next((i for i in range(min(map(len, gathered))) if len({g[i] for g in gathered}) > 1), 0)
        raise ValueError(f"enable_context_parallel: the processes' {name}s hold different attention processors "
                         f"({modules[i][0]}: {', '.join(g[i] for g in gathered)}, by process; patched on some of them "
                         "only?): patch every process alike, before or after enable_context_parallel")


EXCHANGES = ("ulysses", "ring")


def block_norms(transformer) -> list:
    """The transformer's adaLN-Zero block norms of diffusers' (FLUX's), whose modulation products
    ``split_modulation`` splits (patches/modulation_split.py)."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    return [m for m in transformer.modules() if type(m) in (AdaLayerNormZero, AdaLayerNormZeroSingle)]


def _block_norms(transformer, name: str, degree: int) -> list:
    """``block_norms`` where ``split_modulation`` can split them over ``degree`` processes; a ValueError
    where it cannot."""
    norms = block_norms(transformer)
    why = modulation_split.reason(norms, degree) if norms else (
        f"this {name} has no adaLN-Zero block norms of diffusers' (the FP8 tier, patch(pipe, precision='fp8'), "
        "replaces them with its own, which compute their products themselves)")
    if why is not None:
        raise ValueError(f"enable_context_parallel: split_modulation: {why}")
    return norms


def enable_split_modulation(transformer) -> list:
    """``enable_context_parallel``'s ``split_modulation`` for a FLUX transformer already under diffusers' context
    parallelism (a no-op where its norms are split already); called alike on every process. Returns the block
    norms split (``modulation_split.disable`` of them undoes it)."""
    cp = getattr(getattr(transformer, "_parallel_config", None), "context_parallel_config", None)
    if cp is None:
        raise ValueError("split_modulation: the transformer is not under context parallelism (enable_context_parallel)")
    group = cp._flattened_mesh.get_group()
    norms = _block_norms(transformer, type(transformer).__name__, group.size())
    if not all(modulation_split.covers(n) for n in norms):
        modulation_split.enable(norms, group)
    return norms


def _enable_diffusers_plan(transformer, name: str, degree: int, exchange: str):
    """diffusers' ``enable_parallelism`` with its own plan (FLUX) at ``degree``, by ``exchange``; checked first,
    on every process alike: the heads Ulysses splits, the same attention processors on every process (the
    ring's exchange of sd_kernels' processors and that of diffusers' lay the keys out differently). Then
    the check of the processes' arguments (``_Agree``)."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig

    config = ContextParallelConfig(**{f"{exchange}_degree": degree})
    flux = flux_attention.flux_attention_class()
    attention = [(path, m) for path, m in transformer.named_modules() if flux is not None and isinstance(m, flux)]
    for _, m in attention:
        context_parallel.check_heads(m.heads, ParallelConfig(context_parallel_config=config), name)
    _same_processors(attention, name)
    transformer.enable_parallelism(config=config)
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(_Agree(), _GUARD)
    return transformer


def enable_context_parallel(obj, degree: int | None = None, exchange: str = "ulysses", split_modulation: bool = False):
    """One image's tokens over the processes of torch.distributed's default group: diffusers'
    ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))`` on ``obj``'s transformer
    (a pipeline or the transformer), with sd_kernels' plan for SD3 and PixArt-Σ, diffusers' own for
    FLUX. ``degree``: the number of processes (the default); every process calls it alike, before or
    after ``sd_kernels.patch``. ``exchange="ring"`` (FLUX): ``ContextParallelConfig(ring_degree=degree)``
    instead, whose attention sd_kernels runs as one all-gather of the keys and values and one attention
    call (patches/context_parallel.py). ``split_modulation`` (FLUX): each process computes 1/W of the
    blocks' adaLN modulations and one all-gather shares them (patches/modulation_split.py; taken by the
    blocks ``sd_kernels.patch`` fuses). Returns the transformer. Checked first, on every process alike:
    a process group, a transformer with a plan, the degree, the heads it must divide."""
    if exchange not in EXCHANGES:
        raise ValueError(f"enable_context_parallel: exchange must be one of {EXCHANGES}, got {exchange!r}")
    group_or_error("context parallelism")
    transformer = getattr(obj, "transformer", None) if hasattr(obj, "components") else obj
    if transformer is None:
        raise ValueError(f"enable_context_parallel: this {type(obj).__name__} has no transformer to split (a UNet "
                         "pipeline's one image goes over 2 processes with patch(pipe, parallel='cfg'))")
    name = type(transformer).__name__
    if cfg_parallel.splits_guidance(transformer):
        raise ValueError(f"enable_context_parallel: this {name} is patched with parallel='cfg', which hands each "
                         "process a different half of the guidance batch, and context parallelism exchanges tokens "
                         "assuming every process holds the same images (a wrong image): unpatch it, or patch without "
                         "parallel=")
    world = dist.get_world_size()
    degree = world if degree is None else degree
    if degree != world or degree < 2:
        raise ValueError(f"enable_context_parallel: degree={degree}: {exchange} over all {world} processes of the "
                         "default group needs degree equal to their number, and at least 2 (start more processes)")
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"enable_context_parallel: this {name} is already under diffusers' parallelism (it cannot be "
                         "applied twice)")
    plan = plan_for(transformer)
    if plan is None and getattr(transformer, "_cp_plan", None) is None:
        raise ValueError(f"enable_context_parallel: no context-parallel plan for {name} (sd_kernels': "
                         f"{', '.join(PLANNED)}; or diffusers' own, e.g. FLUX)")
    from diffusers import ContextParallelConfig

    if exchange == "ring" and plan is not None:
        raise ValueError(f"enable_context_parallel: exchange='ring' runs under diffusers' own plans (FLUX); "
                         f"sd_kernels' plan for {name} exchanges by Ulysses (exchange='ulysses')")
    if split_modulation and plan is not None:
        raise ValueError(f"enable_context_parallel: split_modulation splits FLUX's adaLN modulations; {name} has "
                         "sd_kernels' plan, which does not take it")
    if plan is None:  # diffusers' plan (FLUX): our processors check their heads as they do under it
        if split_modulation:
            _block_norms(transformer, name, degree)  # its refusal before any change
        _enable_diffusers_plan(transformer, name, degree, exchange)
        if split_modulation:
            enable_split_modulation(transformer)
        return transformer
    modules = _exchanging(transformer)
    for path, attn in modules:
        if attn.heads % degree:
            raise ValueError(f"{name}: Ulysses attention gives each of the {degree} processes 1/{degree} of the "
                             f"heads, and {degree} does not divide {path}'s {attn.heads} heads: run a number of "
                             f"processes that divides {attn.heads}")
    _same_processors(modules, name)
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree), cp_plan=plan)
    cp = transformer._parallel_config.context_parallel_config
    ulysses = Ulysses(cp._ulysses_mesh.get_group(), degree, cp._ulysses_local_rank)
    for _, attn in modules:
        setattr(attn, MARK, ulysses)
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(_Check(modules, degree), _GUARD)
    return transformer
