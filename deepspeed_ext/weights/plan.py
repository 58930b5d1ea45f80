"""Who holds what of a live engine's weights, and how the full tensors are put back together from it.

Every rank of the engine describes the pieces of the module's weights it keeps (its TP or EP shard of each
parameter; under ZeRO-3 its partition of that shard); the ranks exchange those descriptions once, and each
computes the same :class:`WeightPlan`: for every tensor, which rank sends which range of which shard. A shard
held whole by several ranks (DP replicas) is sent by one of them, the one with the fewest bytes so far, so the
sending is spread over the ranks and no rank gathers the model. The plan is plain data: it travels to the
receivers of :func:`~deepspeed_ext.weights.transfer.send_weights` as JSON, and they assemble with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

#: A plan's dtypes, by name on the wire.
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.int8,
    torch.bool)}


#: Each piece starts on a multiple of this many bytes in a bucket's buffer (the widest dtype's size).
ALIGN = 8


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"weight update: unknown dtype {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of shard ``shard`` of a tensor (flattened), as rank ``owner`` sends them."""

    owner: int
    shard: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the module: its layout over the shards (TP ranks, or EP ranks for an expert stack), its
    dtype, whether an optimizer steps it, and the pieces that make it up."""

    name: str
    layout: TPLayout
    dtype: torch.dtype
    trainable: bool
    pieces: tuple[Piece, ...]

    @property
    def shards(self) -> tuple[int, ...]:
        """The shards the full tensor is made from: one of a replicated tensor, else every non-empty one."""
        if self.layout.is_replicated:
            return (0, )
        return tuple(s for s in range(self.layout.tp_size) if math.prod(self.layout.local_shape(s)))

    @property
    def nbytes(self) -> int:
        return sum(piece.numel for piece in self.pieces) * self.dtype.itemsize

    def assemble(self, shard_values: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The full tensor from each needed shard's flat values (:meth:`shards`)."""
        layout = self.layout
        if layout.is_replicated:
            return shard_values[0].reshape(layout.shape)
        shards = [shard_values[s].reshape(layout.local_shape(s)) if s in shard_values else
                  torch.empty(layout.local_shape(s), dtype=self.dtype) for s in range(layout.tp_size)]
        return layout.merge(shards, check_replicas=False)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "layout": self.layout.to_json(), "dtype": dtype_name(self.dtype),
                "trainable": self.trainable, "pieces": [[p.owner, p.shard, p.start, p.stop] for p in self.pieces]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorPlan:
        return cls(str(data["name"]), TPLayout.from_json(data["layout"]), dtype_of(data["dtype"]),
                   bool(data["trainable"]), tuple(Piece(*map(int, p)) for p in data["pieces"]))


@dataclass(frozen=True)
class Holding:
    """What one rank keeps of one tensor: elements ``[start, stop)`` of shard ``shard``."""

    name: str
    shard: int
    start: int
    stop: int


@dataclass
class WeightPlan:
    """Every tensor of the module, in the module's order, and how many ranks send."""

    tensors: list[TensorPlan]
    ranks: int
    #: What a source over the plan reports: the model's config, class and adapters, as the checkpoints record them.
    model_config: Mapping[str, Any] | None = None
    model_class: str | None = None
    adapters: Mapping[str, Any] | None = None
    by_name: dict[str, TensorPlan] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tensors}

    def only(self, names: Iterable[str]) -> WeightPlan:
        wanted = set(names)
        return WeightPlan([t for t in self.tensors if t.name in wanted], self.ranks, self.model_config,
                          self.model_class, self.adapters)

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "tensors": [t.to_json() for t in self.tensors],
                "model_config": self.model_config, "model_class": self.model_class, "adapters": self.adapters}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightPlan:
        return cls([TensorPlan.from_json(t) for t in data["tensors"]], int(data["ranks"]), data.get("model_config"),
                   data.get("model_class"), data.get("adapters"))


def plan_from_holdings(layouts: Mapping[str, TPLayout], dtypes: Mapping[str, torch.dtype],
                       trainable: Mapping[str, bool], holdings: Sequence[Sequence[Holding]]) -> list[TensorPlan]:
    """The plan of every tensor in ``layouts`` (the module's order) from each rank's holdings (``holdings[rank]``):
    every range of every needed shard sent once, replicas' work given to the rank with the fewest bytes so far."""
    held: dict[str, dict[int, list[tuple[int, int, int]]]] = {}
    for rank, rank_holdings in enumerate(holdings):
        for holding in rank_holdings:
            held.setdefault(holding.name, {}).setdefault(holding.shard, []).append(
                (holding.start, holding.stop, rank))
    load = [0] * len(holdings)
    plans = []
    for name, layout in layouts.items():
        dtype = dtypes[name]
        partial = TensorPlan(name, layout, dtype, trainable[name], ())
        pieces = []
        for shard in partial.shards:
            numel = math.prod(layout.local_shape(shard))
            candidates = sorted(held.get(name, {}).get(shard, []))
            position = 0
            while position < numel:
                covering = [(start, stop, rank) for start, stop, rank in candidates if start <= position < stop]
                if not covering:
                    raise CheckpointError(f"{name}: no rank holds elements from {position} of shard {shard} "
                                          f"({numel} elements): the engine's ranks disagree on its layout")
                start, stop, rank = min(covering, key=lambda c: (load[c[2]], c[2]))
                stop = min(stop, numel)
                pieces.append(Piece(rank, shard, position, stop))
                load[rank] += (stop - position) * dtype.itemsize
                position = stop
        plans.append(TensorPlan(name, layout, dtype, trainable[name], tuple(pieces)))
    return plans


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of a plan sent together: each owner's pieces packed in one byte buffer, in plan order."""

    tensors: tuple[TensorPlan, ...]
    #: owner -> its pieces, in the order they lie in its buffer, with their tensor.
    packed: Mapping[int, tuple[tuple[TensorPlan, Piece], ...]]

    def placed(self, owner: int) -> list[tuple[TensorPlan, Piece, int]]:
        """``owner``'s pieces with their byte offsets in its buffer: each on a multiple of :data:`ALIGN`, so every
        piece can be viewed in its own dtype where it lies."""
        placed, offset = [], 0
        for plan, piece in self.packed.get(owner, ()):
            placed.append((plan, piece, offset))
            offset += -(-piece.numel * plan.dtype.itemsize // ALIGN) * ALIGN
        return placed

    def buffer_bytes(self, owner: int) -> int:
        return sum(-(-piece.numel * plan.dtype.itemsize // ALIGN) * ALIGN for plan, piece in self.packed.get(owner, ()))

    def unpack(self, buffers: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The bucket's full tensors from each owner's received byte buffer."""
        shard_parts: dict[str, dict[int, list[tuple[int, torch.Tensor]]]] = {}
        for owner in self.packed:
            buffer = buffers[owner]
            for plan, piece, offset in self.placed(owner):
                values = buffer[offset:offset + piece.numel * plan.dtype.itemsize].view(plan.dtype)
                shard_parts.setdefault(plan.name, {}).setdefault(piece.shard, []).append((piece.start, values))
        full = {}
        for plan in self.tensors:
            shards = {}
            for shard, parts in shard_parts.get(plan.name, {}).items():
                parts.sort(key=lambda part: part[0])
                shards[shard] = parts[0][1] if len(parts) == 1 else torch.cat([values for _, values in parts])
            full[plan.name] = plan.assemble(shards)
        return full


def buckets_of(tensors: Sequence[TensorPlan], bucket_bytes: int) -> list[Bucket]:
    """``tensors`` in consecutive groups of at most ``bucket_bytes`` (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in tensors:
        if groups[-1] and size + plan.nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(plan)
        size += plan.nbytes
    buckets = []
    for group in groups:
        if not group:
            continue
        packed: dict[int, list[tuple[TensorPlan, Piece]]] = {}
        for plan in group:
            for piece in plan.pieces:
                packed.setdefault(piece.owner, []).append((plan, piece))
        buckets.append(Bucket(tuple(group), {owner: tuple(entries) for owner, entries in sorted(packed.items())}))
    return buckets
