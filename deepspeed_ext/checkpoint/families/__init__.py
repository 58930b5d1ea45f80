"""Model families: how a model's (= universal) parameter names map to MaxText paths and HF file names.

The registry: one module per family in :data:`FAMILY_MODULES`, each exporting ``FAMILIES`` (its
:class:`Family` objects). A module holds data only: everything about its families — the HF ``model_type``
(and RoPE type) that identifies them, one :class:`Rule` per parameter, and where transformers' files name
parameters differently from the model, :class:`ExpertSplit` entries. Adding a family is one new module plus
its name in :data:`FAMILY_MODULES`. The
transforms the rules name (transpose, per-head reshape, query scaling, RoPE interleave, expert split)
are part of the MaxText format and live in :mod:`deepspeed_ext.checkpoint.maxtext`; the HF file layout
lives in :mod:`deepspeed_ext.checkpoint.hf`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepspeed_ext.errors import CheckpointError

LAYER = "{layer}"  # in Rule.hf: the decoder layer index
LAYERS = "{layers}"  # in Rule.path: the layer block's path ("layers" when scanned, "layers_<i>" when not)
EXPERT = "{expert}"  # in ExpertSplit.pieces: the expert index


@dataclass(frozen=True)
class Rule:
    """One HF parameter ⇄ one MaxText leaf (an HF tensor may feed several rules, e.g. fused experts)."""

    hf: str  # HF name, with "{layer}" for per-layer parameters
    path: str  # MaxText path under params/params, "/"-separated, with "{layers}" for per-layer leaves
    kind: str  # the transform (see maxtext.TRANSFORMS)
    block: str | None = None  # per-layer rules: the LayerBlock kind it belongs to (None: every block)
    #: The variable collection beside ``params`` in MaxText's tree (``MoEBiasVar``: DeepSeek's router bias,
    #: which MaxText updates outside the optimizer, so it has no Adam moments).
    collection: str = "params"
    #: Scanned: the axis the layers are stacked on (MaxText moves nnx.Param stacks to axis 1; other
    #: collections keep axis 0).
    scan_axis: int = 1
    #: More HF parameters whose rows follow ``hf``'s into this one leaf: the transform takes them stacked on axis 0,
    #: in this order, and its inverse gives them back so (Qwen3.5's ``in_proj_qkv`` and ``in_proj_z``, which MaxText
    #: holds as one kernel laid out per key head).
    fused: tuple[str, ...] = ()

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf

    @property
    def sources(self) -> tuple[str, ...]:
        """The HF parameters of the leaf, in the order their rows are stacked: ``hf``, then ``fused``."""
        return (self.hf, *self.fused)


@dataclass(frozen=True)
class LayerBlock:
    """Decoder layers that MaxText keeps under one path (what replaces ``{layers}`` in a rule's path).

    Unscanned, every layer is a block of its own (``layers_<i>``). Scanned, a block stacks its layers on
    axis 1 in the order of ``layers``; families whose layers repeat in a cycle (gemma3's five local and one
    global layer, gpt-oss's local/global pairs) scan one stack per position in the cycle, and the layers
    left over after the last whole cycle stay unstacked.
    """

    path: str  # e.g. "layers", "layers_3", "layers/layers_2", "layers_remainder/layers_0"
    layers: tuple[int, ...]  # HF decoder layer indices, in stack order
    stacked: bool  # scanned: the layers are stacked on axis 1 (else exactly one layer)
    kind: str = ""  # which rules apply: those whose ``block`` is None or this kind
    #: Stacked: the stack's extent on consecutive axes from the scan axis on, ``layers`` in row-major order over
    #: them (empty: one axis). MaxText nests a scan in a scan for Qwen3-Next's linear-attention layers: (cycles,
    #: layers per cycle).
    stack: tuple[int, ...] = ()


def plain_blocks(config: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    """One stack of every layer (scanned), or ``layers_<i>`` each."""
    num_layers = int(config["num_hidden_layers"])
    if scanned:
        return (LayerBlock("layers", tuple(range(num_layers)), True), )
    return tuple(LayerBlock(f"layers_{i}", (i, ), False) for i in range(num_layers))


def cycle_blocks(config: Mapping[str, Any], scanned: bool, *, cycle: int,
                 remainder: str | None) -> tuple[LayerBlock, ...]:
    """Scanned: ``layers/layers_<j>`` stacks layers j, j+cycle, ... over the whole cycles; the layers left
    over go to ``<remainder>/layers_<r>`` unstacked (``remainder`` None: the layer count must be whole cycles).
    Unscanned: ``layers_<i>`` each, as :func:`plain_blocks`. A family binds ``cycle`` and ``remainder``
    (``functools.partial``)."""
    if not scanned:
        return plain_blocks(config, False)
    num_layers = int(config["num_hidden_layers"])
    repeats, left = divmod(num_layers, cycle)
    if left and remainder is None:
        raise CheckpointError(f"{num_layers} decoder layers are not whole cycles of {cycle}, which scanned MaxText "
                              f"needs for this family; write it with --no-scan-layers")
    stacks = tuple(LayerBlock(f"layers/layers_{j}", tuple(range(j, repeats * cycle, cycle)), True)
                   for j in range(cycle) if repeats)
    rest = tuple(LayerBlock(f"{remainder}/layers_{r}", (repeats * cycle + r, ), False) for r in range(left))
    return stacks + rest


@dataclass(frozen=True)
class ExpertSplit:
    """A fused expert parameter that HF checkpoint files store one tensor per expert.

    transformers 5.x models hold a layer's experts as one 3-D parameter ``[E, ...]`` but read and write
    the per-expert tensors of older checkpoints. Expert ``e``'s slice ``param[e]`` is cut into
    ``len(pieces)`` equal parts along its first axis, in the order of ``pieces`` (gate rows before up rows).
    A single piece without ``{expert}`` is the whole parameter under another name in the files (Mixtral's
    router is ``block_sparse_moe.gate`` on disk, ``mlp.gate`` in the model).
    """

    param: str  # the model's name, with "{layer}"
    pieces: tuple[str, ...]  # the file's names, with "{layer}" and "{expert}"


def partition_config(*specs: Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed ``tensor_parallel`` section's keys naming exactly these AutoTP layer specs (DeepSpeed's defaults
    off): what a family's ``tensor_parallel`` preset holds."""
    return {"partition_config": {"use_default_specs": False, "layer_specs": [dict(spec) for spec in specs]}}


@dataclass(frozen=True)
class Family:
    """A model family's MaxText conventions."""

    name: str
    rules: tuple[Rule, ...]
    #: MaxText bakes 1/sqrt(head_dim) into the query kernel for this family (llama2/3.1, mistral, mixtral).
    query_scaled: bool
    #: MaxText uses adjacent-pair (Meta/GPT-J) RoPE for this family (llama3.1): q/k heads are interleaved.
    rope_interleaved: bool
    #: MaxText's model_name for the family (its config yml sets the decoder block and the family's switches); None:
    #: no MaxText mapping (to-maxtext refuses the family, saying why in ``maxtext_note``).
    maxtext_model: str | None
    #: The HF ``model_type`` the family reads (``config.json``).
    model_type: str = ""
    #: Among families of one model_type, the HF RoPE type that picks this one (None: the default).
    rope_type: str | None = None
    #: Rules for the untied output projection; dropped when the model ties it to the embedding.
    untied_rules: tuple[Rule, ...] = ()
    #: Where which parameters a model has depends on its config (Gemma 4: per-layer inputs, KV-shared layers, an MoE
    #: block), the rules of a config, which replace ``rules`` (None: ``rules`` for every config).
    config_rules: Callable[[Mapping[str, Any]], tuple[Rule, ...]] | None = None
    #: How transformers' files split the model's fused expert parameters (none: the files use the model's names).
    hf_expert_splits: tuple[ExpertSplit, ...] = ()
    #: MaxText settings beyond the sizes every family shares, from the HF config (see maxtext.maxtext_settings).
    maxtext_extra: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    #: The MaxText layer blocks, from the HF config and scanning (default: one stack, or layers_<i>).
    layer_blocks: Callable[[Mapping[str, Any], bool], tuple[LayerBlock, ...]] = plain_blocks
    #: Keys for a DeepSpeed config's ``tensor_parallel`` section that AutoTP needs for the family (a
    #: ``partition_config``; None: AutoTP's defaults work); users get them from deepspeed_ext.presets.
    tensor_parallel: Mapping[str, Any] | None = None
    #: DeepSpeed AutoEP's ``expert_parallel.preset_model`` for the family, or the keys of the ``expert_parallel``
    #: section (a preset and the settings that fit it to the family's MoE block); None: AutoEP cannot run it.
    expert_parallel: str | Mapping[str, Any] | None = None
    #: Without a MaxText mapping: why (MaxText has no such model, or which of MaxText's models it would be).
    maxtext_note: str = ""
    #: Module names (regular expressions over the name's tail, layer indices as ``\d+``) of row-split layers whose
    #: output the model modifies in place, which an AutoTP layer's output forbids: the engine clones it (see
    #: deepspeed_ext.module_inject.inplace_outputs).
    inplace_outputs: tuple[str, ...] = ()
    #: Where AutoEP names the family's MoE block otherwise than the names deepspeed_ext.checkpoint.expert_names
    #: maps by default: (AutoEP's suffix, the model's suffix) under a block (Qwen3.5's ``shared_expert``, which
    #: AutoEP holds as ``shared_experts``).
    autoep_renamed: tuple[tuple[str, str], ...] = ()
    #: Where a release names its files otherwise than transformers' ``save_pretrained`` does (what to-hf writes, and
    #: :attr:`hf_expert_splits` maps): (the release's name prefix, save_pretrained's), the first that starts a name
    #: applying (DeepSeek-V4's ``layers.`` for ``model.layers.``, ``embed.weight`` for ``model.embed_tokens.weight``).
    hf_release_prefixes: tuple[tuple[str, str], ...] = ()
    #: The name prefix of a release's multi-token-prediction layers where they are not decoder layers past
    #: ``num_hidden_layers`` as DeepSeek-V3's are (DeepSeek-V4's ``mtp.``): set aside as those are (``--mtp``).
    hf_mtp_prefix: str | None = None

    def rules_for(self, tied: bool, config: Mapping[str, Any] | None = None) -> tuple[Rule, ...]:
        """The rules of a model (``config``: its HF config, which families with :attr:`config_rules` need)."""
        if self.config_rules is not None and config is None:
            raise CheckpointError(f"internal: family {self.name}'s parameters depend on the model config")
        rules = self.rules if self.config_rules is None else self.config_rules(config or {})
        return rules if tied else rules + self.untied_rules


def num_experts(config: Mapping[str, Any]) -> int:
    """The routed expert count of an HF MoE config: transformers 5 writes ``num_local_experts``, older configs
    (Qwen3-MoE, DeepSeek) ``num_experts`` or ``n_routed_experts``."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    raise CheckpointError("model config: no expert count (num_local_experts / num_experts)")


#: The family modules (under this package), each exporting ``FAMILIES``.
FAMILY_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_next",
                  "gemma4", "deepseek_v32", "llama4", "olmo3", "glm4_moe", "minimax_m2", "deepseek_v4")


def _families() -> dict[str, Family]:
    import importlib
    found = [family for module in FAMILY_MODULES
             for family in importlib.import_module(f"{__name__}.{module}").FAMILIES]
    return {family.name: family for family in found}


def family_names() -> list[str]:
    return list(_families())


def maxtext_family_names() -> list[str]:
    """The families deepspeed-ext writes and reads as MaxText checkpoints."""
    return [name for name, family in _families().items() if family.maxtext_model]


def require_maxtext(family: Family, source: str) -> Family:
    """``family``, refused in one line when it has no MaxText mapping."""
    if not family.maxtext_model:
        raise CheckpointError(f"{source}: family {family.name} has no MaxText mapping ({family.maxtext_note}); "
                              f"MaxText checkpoints are written for: {', '.join(maxtext_family_names())}")
    return family


def get_family(name: str) -> Family:
    """The family called ``name`` (``qwen3_moe``, the HF spelling, is read as ``qwen3-moe``), or the family of the
    HF ``model_type`` ``name`` (``glm4_moe``: glm-4.5; a text model's type without its ``_text``: ``qwen3_5_moe``)."""
    families = _families()
    family = families.get(name) or families.get(name.replace("_", "-"))
    if family is None:
        by_type = [f for f in families.values() if f.model_type in (name, f"{name}_text")]
        family = next((f for f in by_type if f.rope_type is None), None)
    if family is None:
        raise CheckpointError(f"unknown model family {name!r}; known: {', '.join(families)}")
    return family


def families_of_model_type(model_type: str | None) -> list[Family]:
    """The families that read HF ``model_type`` (llama: llama and llama3.1)."""
    return [family for family in _families().values() if model_type and family.model_type == model_type]


def autoep_renamed(model_type: str | None) -> tuple[tuple[str, str], ...]:
    """The AutoEP renames of ``model_type``'s family (None: every family's; see :attr:`Family.autoep_renamed`)."""
    families = families_of_model_type(model_type) if model_type else list(_families().values())
    return tuple(dict.fromkeys(pair for family in families for pair in family.autoep_renamed))


def hf_expert_splits(model_type: str | None) -> tuple[ExpertSplit, ...]:
    """How ``model_type``'s HF files split its fused expert parameters (none: the files use the model's names)."""
    return next((f.hf_expert_splits for f in _families().values() if f.model_type == model_type), ())


def hf_release_naming(model_type: str | None) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """``model_type``'s release naming: :attr:`Family.hf_release_prefixes` and :attr:`Family.hf_mtp_prefix`."""
    family = next((f for f in _families().values() if f.model_type == model_type), None)
    return (family.hf_release_prefixes, family.hf_mtp_prefix) if family is not None else ((), None)


def infer_family(model_config: Mapping[str, Any], source: str = "model config") -> Family:
    """The family of an HF config: its ``model_type``, and among families of one type the RoPE type (Llama with
    llama3 RoPE scaling is llama3.1)."""
    model_type = model_config.get("model_type")
    rope = model_config.get("rope_scaling") or model_config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") if isinstance(rope, Mapping) else None
    candidates = [f for f in _families().values() if f.model_type == model_type]
    if not candidates:
        raise CheckpointError(f"{source}: model_type {model_type!r} has no MaxText mapping; pass --family "
                              f"({', '.join(family_names())})")
    return next((f for f in candidates if f.rope_type == rope_type),
                next((f for f in candidates if f.rope_type is None), candidates[0]))
