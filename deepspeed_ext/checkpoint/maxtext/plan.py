"""The leaf plan: which MaxText leaf each HF parameter goes to (a family's rules, laid out over its layer blocks),
checked against the checkpoint's parameters in both directions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

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
    #: Stacked: how many axes from ``scan_axis`` on the stack spans (2 for a scan nested in a scan: Qwen3-Next's
    #: linear-attention layers, cycles x layers per cycle); ``layers`` run over them in row-major order.
    stack_rank: int = 1

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def stack_axes(self) -> range:
        """The axes the layers are stacked on (none when unstacked)."""
        return range(self.scan_axis, self.scan_axis + self.stack_rank) if self.stacked else range(0)

    def stack_index(self, position: int) -> tuple[int, ...]:
        """Where the stack's ``position``-th layer lies on :attr:`stack_axes`."""
        extents = self.shape[self.scan_axis:self.scan_axis + self.stack_rank]
        return tuple(int(i) for i in np.unravel_index(position, extents))


def layer_blocks(family: Family, dims: ModelDims, scan_layers: bool) -> tuple[LayerBlock, ...]:
    return family.layer_blocks(dims.config or {"num_hidden_layers": dims.num_layers}, scan_layers)


def rule_blocks(rule: Rule, blocks: Iterable[LayerBlock]) -> list[LayerBlock]:
    """The layer blocks a per-layer rule has a leaf in."""
    return [block for block in blocks if rule.block is None or rule.block == block.kind]


def plan_leaves(family: Family, dims: ModelDims, hf_shapes: Mapping[str, tuple[int, ...]], scan_layers: bool,
                source: str = "source") -> list[Leaf]:
    """Every MaxText leaf of the model, checked against the source's parameters in both directions."""
    rules = family.rules_for(dims.tied, dims.config)
    blocks = layer_blocks(family, dims, scan_layers)
    used: set[str] = set()
    leaves = []
    for rule in rules:
        mine = rule_blocks(rule, blocks) if rule.per_layer else []
        groups = [tuple(hf.replace(LAYER, str(layer)) for hf in rule.sources)
                  for block in mine for layer in block.layers] if rule.per_layer else [rule.sources]
        missing = [name for group in groups for name in group if name not in hf_shapes]
        if missing:
            raise CheckpointError(f"{source}: family {family.name!r} expects {missing[0]!r}"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the "
                                  "checkpoint does not have; wrong --family?")
        if not groups:
            continue
        used.update(name for group in groups for name in group)
        transform = TRANSFORMS[rule.kind]
        shapes = {transform.shape(stacked_shape([tuple(hf_shapes[name]) for name in group], source), dims)
                  for group in groups}
        if len(shapes) != 1:
            raise CheckpointError(f"{source}: {rule.hf} has different shapes across layers: {sorted(shapes)}")
        (shape, ) = shapes
        if not rule.per_layer:
            leaves.append(Leaf(tuple(rule.path.split("/")), shape, rule, None, collection=rule.collection))
            continue
        for block in mine:
            path = tuple(rule.path.replace(LAYERS, block.path).split("/"))
            if block.stacked:
                axis, stack = rule.scan_axis, block.stack or (len(block.layers), )
                leaves.append(Leaf(path, (*shape[:axis], *stack, *shape[axis:]), rule, block.layers,
                                   stacked=True, collection=rule.collection, scan_axis=axis, stack_rank=len(stack)))
            else:
                leaves.append(Leaf(path, shape, rule, block.layers, collection=rule.collection))
    unmapped = sorted(set(hf_shapes) - used)
    if unmapped:
        raise CheckpointError(f"{source}: {len(unmapped)} parameters have no place in family {family.name!r} "
                              f"(e.g. {unmapped[:3]}); wrong --family?")
    return leaves


def stacked_shape(shapes: list[tuple[int, ...]], source: str = "source") -> tuple[int, ...]:
    """The shape of HF tensors stacked on axis 0 (a rule's :attr:`~Rule.sources`; one tensor: its own shape)."""
    if len(shapes) == 1:
        return shapes[0]
    if len({shape[1:] for shape in shapes}) != 1:
        raise CheckpointError(f"{source}: tensors fused into one MaxText leaf differ beyond their rows: {shapes}")
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])
