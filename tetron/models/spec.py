"""A model family, described once: what tetron needs to know about a model beyond its own code.

Every parallel strategy, the checkpoints and the planner read a family's `ModelSpec`, never its module
names: its Hugging Face `model_type`s, its config and module classes, and its `ParallelPlan` (where the
decoder layers, the embedding, the final norm and the head are; which linears of a layer are column- or
row-parallel; which parts stay whole inside a tp block and which sit outside every block; which parameters are
split by head). A new family is a plain single-device module class, a config dataclass, and one
`register(ModelSpec(...))` in a folder or module of its own; no axis's file changes.

What the module class must offer (Llama's, models/llama/, is the pattern): it is built from its config
(`model_class(config)`, on the meta device too), keeps that config as `.config`, names its tensors as
transformers' class does, has the plan's parts at the plan's paths (a part a pipeline stage drops is set to
None and skipped by `forward`), its decoder layers in a ModuleDict keyed "0", "1", ..., its attention modules
with an `attn_fn(q, k, v, docs, window, **options)` attribute (context parallelism and the KV cache swap it;
models/attention.py's AttentionOptions.extras says which options), `tie_weights()`,
and `forward(input_ids, position_ids, docs)`. Its config dataclass has a `model_type` field, `from_hf`,
`to_hf`, `num_params` and `flops_per_token`, and the Llama size fields that validation checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Init:
    """How a parameter starts: "normal" (N(0, std), drawn from a seed of the run seed and the tensor's name:
    parallel/init.py), "ones" or "zeros"."""

    kind: Literal["normal", "ones", "zeros"]
    std: float = 0.0


@dataclass(frozen=True)
class Block:
    """A part of a decoder layer that tensor parallelism splits with no communication inside: its input
    linears column-parallel (they share one f at the block's input), its output linear row-parallel (g)."""

    path: str  # the block, relative to a decoder layer: "self_attn"
    column: tuple[str, ...]  # its input linears, relative to the block: ("q_proj", "k_proj", "v_proj")
    row: str  # its output linear: "o_proj"


@dataclass(frozen=True)
class ParallelPlan:
    """Where a family's parts are (attribute paths from the model) and how tensor parallelism splits a layer."""

    blocks: tuple[Block, ...]  # the tensor-parallel blocks of one decoder layer, in forward order
    residual_norms: tuple[str, ...]  # a layer's norms on the residual stream (their weights see one rank's tokens
    # under sequence parallelism, so their gradients are summed over tp), relative to the layer
    kept_whole: tuple[str, ...] = ()  # modules inside a tp block that stay whole on every tp rank, relative to
    # the layer: computed from the block's input (whole on every rank after the block's f) or from other kept-whole
    # modules, and feeding the block's per-head computation, so a rank's gradient holds only its heads' share and
    # is summed over tp, with or without sp. Qwen3's per-head q_norm, k_norm; DeepSeek-V3's MLA: q_a_proj,
    # q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm (whole latent projections before the column-parallel b's)
    head_params: tuple[str, ...] = ()  # parameters of a tp block with one entry per attention head (gpt-oss's
    # "self_attn.sinks"): split by head (dim 0) under tp, as the heads are
    projection_norms: tuple[str, ...] = ()  # norms over a whole column-parallel projection's output (OLMo 3's
    # q_norm, k_norm): their weights split with the projection's rows (dim 0), their statistic (the sum of squares
    # over the whole width) summed over tp by the norm's `sum_over_shards`, which tensor parallelism sets
    replicated: tuple[str, ...] = ()  # parts of a layer outside every tp block besides the residual norms, whole
    # on every tp rank (an MoE layer's mlp: router, experts, shared experts); under sp each rank runs them on its
    # own tokens, so their gradients are summed over tp, as the residual norms' are
    layers: str = "model.layers"  # the ModuleDict of decoder layers: the pipeline cuts it; recompute, compile
    # and ZeRO-3's units take its entries
    embedding: str = "model.embed_tokens"  # the token embedding (first stage; vocab-parallel under tp)
    final_norm: str = "model.norm"  # the norm after the last layer (last stage; sequence-parallel under sp)
    head: str = "lm_head"  # the output projection (last stage; column-parallel over the vocabulary)

    def part(self, model: nn.Module, path: str) -> Any:
        """The module at `path` of `model`, or None where a pipeline stage dropped it."""
        for name in path.split("."):
            model = getattr(model, name, None)
            if model is None:
                return None
        return model

    def set_part(self, model: nn.Module, path: str, value: nn.Module | None) -> None:
        """Replace (or, with None, drop) the module at `path`."""
        parent, _, name = path.rpartition(".")
        setattr(self.part(model, parent) if parent else model, name, value)

    @property
    def embedding_weight(self) -> str:
        return f"{self.embedding}.weight"

    @property
    def head_weight(self) -> str:
        return f"{self.head}.weight"

    def tied_head(self, config: Any) -> str | None:
        """The head's weight name where it is the embedding's tensor (stored once, as the embedding), else None."""
        return self.head_weight if config.tie_word_embeddings else None

    def tp_dim(self, name: str) -> int | None:
        """The dim along which tensor parallelism splits a decoder layer's parameter (`self_attn.q_proj.weight`,
        relative to the layer): 0 for column-parallel weights and biases, per-head parameters and the weights of
        norms over a whole projection, 1 for row-parallel weights, None for what stays whole (other norms, a
        row-parallel bias, added once after the sum)."""
        module, _, kind = name.rpartition(".")
        if name in self.head_params or (module in self.projection_norms and kind == "weight"):
            return 0
        for block in self.blocks:
            if module in {f"{block.path}.{c}" for c in block.column}:
                return 0
            if module == f"{block.path}.{block.row}" and kind == "weight":
                return 1
        return None

    def tp_partial(self, name: str, *, sequence_parallel: bool) -> bool:
        """Whether a decoder layer's parameter (`self_attn.q_norm.weight`, relative to the layer) stays whole on
        every tp rank with each rank's gradient a share of the whole, to be summed over tp: what is kept whole
        inside a block always (a share of the heads); with sequence parallelism also what sits outside every
        block, the residual norms and the replicated parts (a share of the tokens). A row-parallel linear's bias
        is the linear's own business (tensor_parallel.RowParallelLinear)."""
        if _under(name, self.kept_whole):
            return True
        return sequence_parallel and _under(name, (*self.residual_norms, *self.replicated))

    def layers_of(self, model: nn.Module) -> nn.ModuleDict:
        """The decoder layers this model (or pipeline chunk) holds, keyed by their global index."""
        return self.part(model, self.layers)

    def stage_part(self, name: str) -> str:
        """Which part a parameter name belongs to: "layer", "embedding" or "end" (final norm, head)."""
        if name.startswith(self.layers + "."):
            return "layer"
        return "embedding" if name.startswith(self.embedding + ".") else "end"

    def layer_index(self, name: str) -> int:
        """The decoder layer of a parameter name inside the layers: `model.layers.3.mlp...` -> 3."""
        return int(name[len(self.layers) + 1:].split(".", 1)[0])


def _under(name: str, paths: tuple[str, ...]) -> bool:
    """Whether parameter `name` belongs to one of the modules at `paths` (all relative to one module)."""
    return any(name.startswith(f"{path}.") for path in paths)


@dataclass(frozen=True)
class ModelSpec:
    """One model family."""

    name: str  # the family's name, also its config's `model_type`: "llama"
    model_types: tuple[str, ...]  # the Hugging Face config.json model_type values it reads: ("llama",)
    config_class: type  # the config dataclass (fields named as transformers' config)
    model_class: type[nn.Module]  # the plain single-device model, transformers' tensor names
    plan: ParallelPlan
    # Where a Hugging Face folder holds a tensor under other names, as the hub and transformers' save_pretrained
    # keep MoE experts one by one: (name, config) -> another tensor's name, or the names of its pieces (row i
    # of the tensor is row i's pieces concatenated along their dim 0), or None (stored as named). tetron's
    # writers store tensors so (split_stored); its readers take either (assemble).
    stored_as: Callable[[str, Any], str | list[list[str]] | None] | None = None
    # The family's initialisation, as transformers' _init_weights of the family: (a module of the plain model,
    # the name of one of its own parameters, the config) -> how that parameter starts. None: models/blocks.py's
    # standard_init (normal(initializer_range), ones for norm weights, zeros for (1 + weight) norms and biases).
    init: Callable[[nn.Module, str, Any], Init] | None = None
    # The config.json model_types of other models whose folders hold one of this family (a multimodal model's text
    # model): config_from_hf reads such a folder's config with this family's from_hf, its tensors through read_as
    holder_types: tuple[str, ...] = ()
    # Where a folder of another model that holds this family's (a multimodal model's text model) keeps a tensor:
    # (name, config) -> the name there, read where the folder lacks both `name` and its stored_as names; never
    # written (tetron's folders are the family's own). None: no such folders.
    read_as: Callable[[str, Any], str | None] | None = None
    # Prefixes of the tensors such a folder holds beside the family's (the other towers, copies the family shares):
    # left unread where any other tensor would be refused as unexpected; a function of the config where they depend
    # on it.
    unread: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()


def piece_names(stored: str | list[list[str]]) -> list[str]:
    """Every tensor name a `ModelSpec.stored_as` answer reads."""
    return [stored] if isinstance(stored, str) else [name for row in stored for name in row]


def assemble(stored: str | list[list[str]], read: Callable[[str], Tensor]) -> Tensor:
    """The tensor a `ModelSpec.stored_as` answer describes, its pieces read by `read(name)`."""
    if isinstance(stored, str):
        return read(stored)
    return torch.stack([torch.cat([read(name) for name in row]) for row in stored])


def piece_shapes(stored: str | list[list[str]], shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a `ModelSpec.stored_as` answer names, with the shape it has for a whole tensor of `shape`
    (row i's pieces cut its dim 0 into equal parts): what a writer puts in a file, what a reader checks."""
    if isinstance(stored, str):
        return [(stored, tuple(shape))]
    if len(stored) != shape[0] or any(shape[1] % len(row) for row in stored):
        raise ValueError(f"{len(stored)} rows of pieces do not cut a tensor of shape {list(shape)}")
    return [(name, (shape[1] // len(row), *shape[2:])) for row in stored for name in row]


def split_stored(stored: str | list[list[str]], tensor: Tensor) -> list[tuple[str, Tensor]]:
    """`tensor` cut into the pieces a `ModelSpec.stored_as` answer names, in piece_shapes' order (assemble's
    inverse; the pieces are views of `tensor`)."""
    if isinstance(stored, str):
        return [(stored, tensor)]
    piece_shapes(stored, tuple(tensor.shape))  # the rows cut it evenly
    return [(name, piece) for row, whole in zip(stored, tensor) for name, piece in zip(row, whole.chunk(len(row)))]


FAMILIES: dict[str, ModelSpec] = {}  # model_type -> family; filled by register()
HOLDERS: dict[str, ModelSpec] = {}  # another model's model_type -> the family its folders hold (holder_types)


def register(spec: ModelSpec) -> ModelSpec:
    """Make a family known by each of its model types (a later registration of a type replaces the earlier)."""
    for model_type in {spec.name, *spec.model_types}:
        FAMILIES[model_type] = spec
    for model_type in spec.holder_types:
        HOLDERS[model_type] = spec
    return spec


def family(model_type: str) -> ModelSpec:
    """The family of a model_type, or a ValueError naming the known ones."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not a known model family; use one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def spec_of(config: Any) -> ModelSpec:
    """The family of a model config (by its model_type)."""
    return family(config.model_type)


def stored_as_of(config: Any) -> Callable[[str], str | list[list[str]] | None] | None:
    """The family's `stored_as` for this config (where a model folder keeps a tensor), or None."""
    stored_as = spec_of(config).stored_as
    return None if stored_as is None else lambda name: stored_as(name, config)


def read_as_of(config: Any) -> Callable[[str], list[str | list[list[str]]]] | None:
    """Where a reader looks for a tensor that a folder does not hold as named: the family's `stored_as`, then its
    `read_as` (another model's folder that holds this family's), in that order; None where the family has neither."""
    spec = spec_of(config)
    if spec.stored_as is None and spec.read_as is None:
        return None
    return lambda name: [other for other in (spec.stored_as and spec.stored_as(name, config),
                                             spec.read_as and spec.read_as(name, config)) if other]


def read_hf_config(path_or_dict: str | os.PathLike | dict) -> dict:
    """A transformers config.json as a dict: from its path, its folder, or the dict itself."""
    if isinstance(path_or_dict, dict):
        hf = path_or_dict
    else:
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no Hugging Face config file at {path}")
        if os.path.getsize(path) > 64 << 20:
            raise ValueError(f"{path} is larger than 64 MiB: not a model config")
        try:
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"{path} is not valid JSON ({type(err).__name__})") from None
    if not isinstance(hf, dict):
        raise ValueError("expected a JSON object of config fields")
    return hf


def refuse_quantized(hf: dict, kept: str, *, how: str = "") -> None:
    """One line for a config.json whose weights are quantized (`quantization_config`): tetron reads bf16/fp32.
    `kept`: how the hub keeps this family's weights; `how`: a way to dequantize them, where there is one."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config: this folder's weights are quantized (quant_method={method!r}; "
                         f"{kept}) and tetron reads bf16/fp32 weights: dequantize it first{how}")


def config_from_hf(path_or_dict: str | os.PathLike | dict) -> Any:
    """A family's config from a transformers config.json (its path, its folder, or the dict); its model_type
    picks the family (a file without one is read as Llama, as older Llama files are)."""
    hf = read_hf_config(path_or_dict)
    model_type = hf.get("model_type", "llama")
    holder = HOLDERS.get(model_type) if isinstance(model_type, str) else None
    return (holder or family(model_type)).config_class.from_hf(hf)
