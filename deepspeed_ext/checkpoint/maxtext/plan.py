"""The leaf plan: which MaxText leaf each HF parameter goes to (a family's rules, laid out over its layer blocks),
checked against the checkpoint's parameters in both directions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from deepspeed_ext.checkpoint.families import LAYER, LAYERS, Family, LayerBlock, Rule
from deepspeed_ext.checkpoint.maxtext.transforms import TRANSFORMS, ModelDims
from deepspeed_ext.errors import CheckpointError


@dataclass(frozen=True)
class Leaf:
    """One MaxText leaf to write: its path, shape, and where its data comes from."""

    path: tuple[str, ...]  # under params/<collection>
    shape: tuple[int, ...]
    rule: Rule | None  # None: a leaf reshard-orbax re-chunks (it needs only the path and shape)
    layers: tuple[int, ...] | None  # the decoder layers it holds; None for a global parameter
    stacked: bool = False  # scanned: ``layers`` stacked on ``scan_axis``
    collection: str = "params"  # MaxText's variable collection (params/<collection>/...)
    scan_axis: int = 1

    @property
    def name(self) -> str:
        return "/".join(self.path)


def layer_blocks(family: Family, dims: ModelDims, scan_layers: bool) -> tuple[LayerBlock, ...]:
    return family.layer_blocks(dims.config or {"num_hidden_layers": dims.num_layers}, scan_layers)


def rule_blocks(rule: Rule, blocks: Iterable[LayerBlock]) -> list[LayerBlock]:
    """The layer blocks a per-layer rule has a leaf in."""
    return [block for block in blocks if rule.block is None or rule.block == block.kind]


def plan_leaves(family: Family, dims: ModelDims, hf_shapes: Mapping[str, tuple[int, ...]], scan_layers: bool,
                source: str = "source") -> list[Leaf]:
    """Every MaxText leaf of the model, checked against the source's parameters in both directions."""
    rules = family.rules_for(dims.tied)
    blocks = layer_blocks(family, dims, scan_layers)
    used: set[str] = set()
    leaves = []
    for rule in rules:
        mine = rule_blocks(rule, blocks) if rule.per_layer else []
        names = [rule.hf.replace(LAYER, str(layer)) for block in mine for layer in block.layers] \
            if rule.per_layer else [rule.hf]
        missing = [name for name in names if name not in hf_shapes]
        if missing:
            raise CheckpointError(f"{source}: family {family.name!r} expects {missing[0]!r}"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the "
                                  "checkpoint does not have; wrong --family?")
        if not names:
            continue
        used.update(names)
        transform = TRANSFORMS[rule.kind]
        shapes = {transform.shape(tuple(hf_shapes[name]), dims) for name in names}
        if len(shapes) != 1:
            raise CheckpointError(f"{source}: {rule.hf} has different shapes across layers: {sorted(shapes)}")
        (shape, ) = shapes
        if not rule.per_layer:
            leaves.append(Leaf(tuple(rule.path.split("/")), shape, rule, None, collection=rule.collection))
            continue
        for block in mine:
            path = tuple(rule.path.replace(LAYERS, block.path).split("/"))
            if block.stacked:
                axis = rule.scan_axis
                leaves.append(Leaf(path, (*shape[:axis], len(block.layers), *shape[axis:]), rule, block.layers,
                                   stacked=True, collection=rule.collection, scan_axis=axis))
            else:
                leaves.append(Leaf(path, shape, rule, block.layers, collection=rule.collection))
    unmapped = sorted(set(hf_shapes) - used)
    if unmapped:
        raise CheckpointError(f"{source}: {len(unmapped)} parameters have no place in family {family.name!r} "
                              f"(e.g. {unmapped[:3]}); wrong --family?")
    return leaves

