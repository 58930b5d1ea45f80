"""DeepSpeed AutoEP (expert parallelism) as a checkpoint records it: which expert parameters there are, how many
experts each EP rank holds (the placement, checked against the affine placement maps where DeepSpeed writes them),
and which ranks' files hold each EP rank's share.

AutoEP replaces each MoE block's experts by stacked parameters (``<block>.experts.w1``: ``[local experts, ...]``)
that EP rank ``e`` holds for its own experts. The model states record, per MoE layer (``ds_autoep_layers``), the
expert count, the EP degree and the experts of every EP rank (``expert_placement``); the optimizer puts the expert
parameters in param groups of their own (``moe: True``, named ``ep_size_<N>``), partitioned by ZeRO over the
expert-data-parallel ranks (the ranks holding the same experts) instead of over every DP rank.

Seen as a layout, an expert parameter is its logical ``[experts, ...]`` tensor split along dimension 0 over the EP
ranks (:meth:`ExpertParam.layout`, role ``"experts"``): the slicing math is then the TP math, with EP ranks for TP
ranks. Which global rank is which (EP rank, expert-DP rank) follows DeepSpeed's expert group construction: with
``use_data_before_expert_parallelism`` off (the default), EP groups are runs of consecutive ranks and rank ``g`` is
EP rank ``g % EP``; with it on, rank ``g`` is EP rank ``g // (DP / EP)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

#: The model-states key of AutoEP's per-layer records (also inside ``universal_checkpoint_info``).
AUTOEP_LAYERS = "ds_autoep_layers"
#: DeepSpeed's config key choosing the rank order of expert groups.
DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"
#: A param group of expert parameters: ``moe`` set, ``name`` ``ep_size_<N>``.
EXPERT_GROUP_NAME_RE = re.compile(r"^ep_size_(\d+)$")
#: The marks upstream's universal files put on an expert parameter (beside ``param`` and ``cat_dim``).
IS_EXPERT_PARAM = "is_expert_param"
EP_NUM_EXPERTS = "ep_num_experts"
#: The role of an expert layout (:class:`TPLayout`): its shards are EP ranks, not TP ranks.
EXPERTS_ROLE = "experts"


@dataclass(frozen=True)
class ExpertParam:
    """One stacked expert parameter (``...experts.w1``) of one MoE layer."""

    name: str
    layer: int
    #: The experts each EP rank holds, in EP-rank order; consecutive ranges covering 0..experts-1.
    placement: tuple[tuple[int, ...], ...]
    #: The logical shape: ``[experts, ...]``.
    shape: tuple[int, ...]

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def layout(self) -> TPLayout:
        """The logical tensor split along the expert dimension over the EP ranks."""
        return expert_layout(self.shape, [len(experts) for experts in self.placement])


def expert_layout(shape: Sequence[int], experts_per_rank: Sequence[int]) -> TPLayout:
    """The layout of a stacked expert parameter of logical ``shape`` whose EP ranks hold ``experts_per_rank``."""
    return TPLayout.split(tuple(shape), len(experts_per_rank), 0, tuple(experts_per_rank), "column",
                          role=EXPERTS_ROLE)


def is_expert_layout(layout: TPLayout) -> bool:
    return layout.role == EXPERTS_ROLE


@dataclass(frozen=True)
class ExpertParallel:
    """A checkpoint's expert parallelism: its expert parameters and where each EP rank's share is."""

    ep_size: int
    #: The ranks of one TP rank's DP group (what ZeRO partitions dense parameters over).
    dp_size: int
    data_before_expert: bool
    params: dict[str, ExpertParam]
    #: AutoEP folded with AutoTP (DeepSpeed's ``folding`` record): the EP rank of each TP rank, whose files hold
    #: that EP rank's experts, partitioned over its DP ranks. None: TP=1, EP over the DP ranks.
    ep_of_tp: tuple[int, ...] | None = None

    @property
    def expert_dp_size(self) -> int:
        """How many ranks hold the same experts (ZeRO partitions an expert group over them)."""
        return self.dp_size if self.ep_of_tp is not None else self.dp_size // self.ep_size

    def holder_files(self, ep_rank: int) -> list[tuple[int, int]]:
        """The (TP rank, DP rank) files holding EP rank ``ep_rank``'s experts, in the order ZeRO partitions them:
        folded, the DP ranks of the TP rank that is that EP rank; else the DP ranks of its expert-DP group."""
        if self.ep_of_tp is not None:
            tp = self.ep_of_tp.index(ep_rank)
            return [(tp, dp) for dp in range(self.dp_size)]
        if self.data_before_expert:
            dps = range(ep_rank * self.expert_dp_size, (ep_rank + 1) * self.expert_dp_size)
        else:
            dps = range(ep_rank, self.dp_size, self.ep_size)
        return [(0, dp) for dp in dps]

    def summary(self) -> dict[str, Any]:
        """What ``inspect`` shows: the EP degree, the experts of each EP rank per layer."""
        layers: dict[int, ExpertParam] = {}
        for param in self.params.values():
            layers.setdefault(param.layer, param)
        placements = {tuple(p.placement) for p in layers.values()}
        per_rank = sorted({len(experts) for p in layers.values() for experts in p.placement})
        return {
            "ep_degree": self.ep_size,
            "expert_dp_degree": self.expert_dp_size,
            "moe_layers": len(layers),
            "experts": sorted({p.num_experts for p in layers.values()}),
            "experts_per_rank": per_rank[0] if len(per_rank) == 1 else per_rank,
            "placement": ({f"ep_rank {rank}": _ranges(experts) for rank, experts in enumerate(next(iter(placements)))}
                          if len(placements) == 1 else "differs between layers"),
            "expert_parameters": len(self.params),
        }


def _ranges(experts: Sequence[int]) -> str:
    return f"{experts[0]}..{experts[-1]}" if len(experts) > 1 else ",".join(map(str, experts))


def read_expert_parallel(model_states: Mapping[str, Any], path: Path, dp_size: int,
                         tp_size: int = 1) -> ExpertParallel | None:
    """The expert parallelism ``path`` (TP rank 0's model states) records; None for a model without AutoEP.

    Refused in one line naming ``path``: records that contradict each other or the parameter shapes, a
    placement that is not consecutive experts per rank (every AutoEP release writes consecutive ones), and an EP
    degree that does not divide the DP degree."""
    layers = model_states.get(AUTOEP_LAYERS)
    if layers is None:
        info = model_states.get(keys.UNIVERSAL_CHECKPOINT_INFO)
        layers = info.get(AUTOEP_LAYERS) if isinstance(info, Mapping) else None
    if not layers:
        return None
    if not isinstance(layers, Sequence):
        raise CheckpointError(f"{path}: {AUTOEP_LAYERS} is a {type(layers).__name__}, not a list")
    shapes: dict[str, tuple[int, ...]] = {}
    groups = model_states.get(keys.PARAM_SHAPES) or []
    for group in (groups if isinstance(groups, list) else [groups]):
        shapes.update({name: tuple(int(d) for d in shape) for name, shape in group.items()})
    ep_sizes: set[int] = set()
    params: dict[str, ExpertParam] = {}
    for record in layers:
        if not isinstance(record, Mapping):
            raise CheckpointError(f"{path}: an {AUTOEP_LAYERS} entry is a {type(record).__name__}, not a dict")
        layer = record.get("moe_layer_id")
        try:
            num_experts, ep_size = int(record["num_experts"]), int(record["ep_size"])
            prefix = str(record["expert_key_prefix"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: AutoEP layer {layer}: no usable {exc} in its record") from None
        placement = _placement(record, num_experts, ep_size, path, layer)
        ep_sizes.add(ep_size)
        names = [name for name in shapes if name.startswith(prefix + ".")]
        if not names:
            raise CheckpointError(f"{path}: AutoEP layer {layer}: no parameter under {prefix!r} in param_shapes")
        for name in names:
            local = shapes[name]
            if not local or local[0] != len(placement[0]):
                raise CheckpointError(f"{path}: expert parameter {name!r} has shape {local}, but EP rank 0 holds "
                                      f"{len(placement[0])} of the layer's {num_experts} experts")
            params[name] = ExpertParam(name=name, layer=int(layer) if layer is not None else -1,
                                       placement=placement, shape=(num_experts, *local[1:]))
            _check_affine_map(record, params[name], path)
    if len(ep_sizes) > 1:
        raise CheckpointError(f"{path}: AutoEP layers at EP degrees {sorted(ep_sizes)}; one EP degree is supported")
    ep_size = ep_sizes.pop()
    if dp_size % ep_size and tp_size == 1:
        raise CheckpointError(f"{path}: EP={ep_size} does not divide DP={dp_size}")
    config = model_states.get(keys.DS_CONFIG)
    data_before = bool(config.get(DATA_BEFORE_EXPERT, False)) if isinstance(config, Mapping) else False
    return ExpertParallel(ep_size=ep_size, dp_size=dp_size, data_before_expert=data_before, params=params)


def _check_affine_map(record: Mapping[str, Any], param: ExpertParam, path: Path) -> None:
    """Where DeepSpeed also wrote the expert stack's affine placement map (``affine_maps``: per EP rank, the pieces of
    the logical tensor it holds, each an element offset and shape), it must say what the placement says: each EP
    rank one piece, its consecutive experts, at their offset in the ``[experts, ...]`` tensor."""
    maps = (record.get("affine_maps") or {}).get("params") or {}
    found = maps.get(param.name) if isinstance(maps, Mapping) else None
    if found is None:
        return
    per_expert = math.prod(param.shape[1:])
    if tuple(int(d) for d in found.get("logical_shape") or ()) != param.shape:
        raise CheckpointError(f"{path}: the affine map of {param.name!r} has logical shape "
                              f"{found.get('logical_shape')}, the placement and param_shapes give {list(param.shape)}")
    ranks = found.get("ranks") or {}
    for ep_rank, experts in enumerate(param.placement):
        entry = ranks.get(ep_rank, ranks.get(str(ep_rank))) if isinstance(ranks, Mapping) else None
        pieces = (entry or {}).get("pieces") or []
        expected = (experts[0] * per_expert, [len(experts), *param.shape[1:]])
        got = [(int(piece["source"][0]), [int(d) for d in piece["shape"]]) for piece in pieces]
        if got != [expected]:
            raise CheckpointError(f"{path}: the affine map of {param.name!r} places EP rank {ep_rank}'s share as "
                                  f"{got} (element offset, shape), not experts {experts[0]}..{experts[-1]} at "
                                  f"{expected}; only such maps are supported")


def _placement(record: Mapping[str, Any], num_experts: int, ep_size: int, path: Path,
               layer: Any) -> tuple[tuple[int, ...], ...]:
    """The experts of each EP rank, as recorded (else AutoEP's even split), checked to be consecutive."""
    recorded = record.get("expert_placement")
    if recorded is None:
        if num_experts % ep_size:
            raise CheckpointError(f"{path}: AutoEP layer {layer}: {num_experts} experts do not divide over EP="
                                  f"{ep_size}")
        per = num_experts // ep_size
        return tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep_size))
    ranks = sorted(recorded.get("ranks") or [], key=lambda entry: int(entry["rank"]))
    placement = tuple(tuple(int(e) for e in entry["experts"]) for entry in ranks)
    if [int(entry["rank"]) for entry in ranks] != list(range(ep_size)):
        raise CheckpointError(f"{path}: AutoEP layer {layer}: expert placement lists ranks "
                              f"{[int(entry['rank']) for entry in ranks]}, not 0..{ep_size - 1}")
    flat = [e for experts in placement for e in experts]
    if flat != list(range(num_experts)):
        raise CheckpointError(f"{path}: AutoEP layer {layer}: expert placement {[list(p) for p in placement]} is not "
                              f"consecutive experts per EP rank covering 0..{num_experts - 1}; only such placements "
                              "are supported")
    return placement


def expert_group_indices(param_groups: Sequence[Mapping[str, Any]]) -> set[int]:
    """Which optimizer param groups hold expert parameters (DeepSpeed marks them ``moe``)."""
    return {index for index, group in enumerate(param_groups) if isinstance(group, Mapping) and group.get("moe")}


#: The model-states key of AutoEP's record of how it folded EP onto the TP ranks.
FOLDING = "folding"


def folded_onto_tp(records: Sequence[Mapping[str, Any] | None], files: Sequence[Path], ep_size: int) -> tuple[int, ...]:
    """The EP rank of each TP rank, from each TP rank's ``folding`` record (``records[t]``, in ``files[t]``): AutoEP
    folded with AutoTP as deepspeed-ext reads it, one EP rank per TP rank (EP = TP, no expert TP). Anything else is
    refused in one line naming the file."""
    found = []
    for tp, (record, path) in enumerate(zip(records, files, strict=True)):
        if not isinstance(record, Mapping):
            raise CheckpointError(f"{path}: AutoEP at TP={len(files)} without DeepSpeed's folding record; "
                                  "deepspeed-ext reads AutoEP with TP > 1 only as DeepSpeed folds it")
        shape = (int(record.get("tp_size", 0)), int(record.get("tp_rank", -1)), int(record.get("ep_size", 0)),
                 int(record.get("etp_size", 1)))
        if shape != (len(files), tp, ep_size, 1) or ep_size != len(files):
            raise CheckpointError(f"{path}: AutoEP folded as TP={shape[0]} (rank {shape[1]}) x EP={shape[2]} x expert "
                                  f"TP={shape[3]}; deepspeed-ext reads the folding of one EP rank per TP rank "
                                  f"(EP = TP = {len(files)}, expert TP 1)")
        found.append(int(record["ep_rank"]))
    if sorted(found) != list(range(ep_size)):
        raise CheckpointError(f"{files[0]}: the TP ranks' folding records give EP ranks {found}, not each of "
                              f"0..{ep_size - 1} once")
    return tuple(found)
