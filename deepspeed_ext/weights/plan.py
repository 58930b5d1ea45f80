"""Who holds what of a live engine's weights, and how the full tensors are put back together from it.

Every rank of the engine describes the pieces of the module's weights it keeps (its TP or EP shard of each
parameter; under ZeRO-3 its partition of that shard); the ranks exchange those descriptions once, and each
computes the same :class:`WeightPlan`: for every tensor, which rank sends which range of which shard. What
several ranks hold (DP replicas; a tensor TP leaves whole) is given out so that the ranks send the same bytes
(whole, or split between them where one tensor would leave one rank the busiest), and no rank gathers the model.
The plan is plain data: it travels to the receivers of :func:`~deepspeed_ext.weights.transfer.send_weights` as
JSON, and they assemble with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout

#: A plan's dtypes, by name on the wire.
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.int8,
    torch.bool)}


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

    @cached_property
    def shards(self) -> tuple[int, ...]:
        """The shards the full tensor is made from: one of a replicated tensor, else every non-empty one."""
        if self.layout.is_replicated:
            return (0, )
        return tuple(s for s in range(self.layout.tp_size) if math.prod(self.layout.local_shape(s)))

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int | None], ...]:
        """``(shard, elements, where it starts in the full tensor flattened)`` of each of :attr:`shards`; the start
        None where the shard's elements do not lie in one run there. Worked out once: a plan serves every update."""
        return tuple((shard, math.prod(self.layout.local_shape(shard)), _run_start(self.layout, shard))
                     for shard in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(piece.numel for piece in self.pieces) * self.dtype.itemsize

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
    _buckets: dict[int, list[Bucket]] = field(init=False, repr=False, compare=False)
    #: The plan of the adapters alone (``engine_side.adapters_plan``), once worked out.
    adapters_only: WeightPlan | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tensors}
        self._buckets = {}

    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """:func:`buckets_of` the plan's tensors, worked out once per size (a plan serves every update)."""
        found = self._buckets.get(bucket_bytes)
        if found is None:
            found = self._buckets[bucket_bytes] = buckets_of(self.tensors, bucket_bytes)
        return found

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


#: A replicated range is split over its holders only into parts at least this big: a part is a message, and a
#: message costs more than sending a few hundred KiB more from one rank.
MIN_SPLIT_BYTES = 4 << 20


def plan_from_holdings(layouts: Mapping[str, TPLayout], dtypes: Mapping[str, torch.dtype],
                       trainable: Mapping[str, bool], holdings: Sequence[Sequence[Holding]], *,
                       min_split_bytes: int = MIN_SPLIT_BYTES) -> list[TensorPlan]:
    """The plan of every tensor in ``layouts`` (the module's order) from each rank's holdings (``holdings[rank]``):
    every range of every needed shard sent once. A range only one rank holds is its to send; the ranges several
    hold (DP replicas, a replicated tensor under TP) balance the ranks' bytes: the whole range to the rank with the
    fewest bytes (counting what it alone will send later) while that keeps the ranks level, else split over its
    holders so that they end level (an update lasts as long as its busiest sender)."""
    held: dict[str, dict[int, list[tuple[int, int, int]]]] = {}
    for rank, rank_holdings in enumerate(holdings):
        for holding in rank_holdings:
            held.setdefault(holding.name, {}).setdefault(holding.shard, []).append(
                (holding.start, holding.stop, rank))
    segments: dict[str, list[tuple[int, int, int, tuple[int, ...]]]] = {}
    load = [0] * len(holdings)  # bytes each rank will send: first those only it holds
    shared = 0
    for name, layout in layouts.items():
        partial = TensorPlan(name, layout, dtypes[name], trainable[name], ())
        found = segments[name] = []
        for shard in partial.shards:
            for start, stop, ranks in _segments(name, shard, math.prod(layout.local_shape(shard)),
                                                held.get(name, {}).get(shard, [])):
                found.append((shard, start, stop, ranks))
                nbytes = (stop - start) * dtypes[name].itemsize
                if len(ranks) == 1:
                    load[ranks[0]] += nbytes
                else:
                    shared += nbytes
    level = (sum(load) + shared) / max(1, len(load))
    plans = []
    for name, layout in layouts.items():
        itemsize = dtypes[name].itemsize
        pieces = []
        for shard, start, stop, ranks in segments[name]:
            if len(ranks) == 1:
                pieces.append(Piece(ranks[0], shard, start, stop))
                continue
            for rank, numel in _shares(ranks, load, stop - start, itemsize, level, min_split_bytes):
                pieces.append(Piece(rank, shard, start, start + numel))
                load[rank] += numel * itemsize
                start += numel
        plans.append(TensorPlan(name, layout, dtypes[name], trainable[name], tuple(pieces)))
    return plans


def _segments(name: str, shard: int, numel: int,
              candidates: Sequence[tuple[int, int, int]]) -> Iterable[tuple[int, int, tuple[int, ...]]]:
    """Elements ``[0, numel)`` of a shard cut where the set of ranks holding them changes: ``(start, stop, ranks)``."""
    cuts = sorted({0, numel, *(min(max(c, 0), numel) for start, stop, _ in candidates for c in (start, stop))})
    for start, stop in zip(cuts, cuts[1:]):
        ranks = tuple(sorted({rank for low, high, rank in candidates if low <= start and stop <= high}))
        if not ranks:
            raise CheckpointError(f"{name}: no rank holds elements from {start} of shard {shard} ({numel} elements): "
                                  "the engine's ranks disagree on its layout")
        yield start, stop, ranks


def _shares(ranks: Sequence[int], load: Sequence[int], numel: int, itemsize: int, level: float,
            min_split_bytes: int) -> list[tuple[int, int]]:
    """How a range several ``ranks`` hold is sent: ``(rank, elements)`` in order. Whole by the least loaded while
    that keeps it at or under ``level`` (or the range is too small to split); else over the least loaded holders,
    each given what brings it to a common level, as many holders as keep every part at least ``min_split_bytes``."""
    order = sorted(ranks, key=lambda r: (load[r], r))
    nbytes = numel * itemsize
    min_split_bytes = max(min_split_bytes, itemsize)  # every part at least one element
    if load[order[0]] + nbytes <= level or nbytes < 2 * min_split_bytes:
        return [(order[0], numel)]
    for count in range(len(order), 1, -1):
        chosen = order[:count]
        common = (sum(load[r] for r in chosen) + nbytes) / count
        parts = [max(0.0, common - load[r]) for r in chosen]
        if all(part >= min_split_bytes for part in parts):
            counts = [int(part // itemsize) for part in parts]
            counts[0] += numel - sum(counts)
            return sorted(zip(chosen, counts))
    return [(order[0], numel)]


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of a plan sent together, owner by owner in the bucket's order (:meth:`messages`): a large
    piece is sent from where its owner keeps it and received where its tensor goes, with no copy on either side."""

    tensors: tuple[TensorPlan, ...]

    def pieces_of(self, owner: int) -> list[tuple[TensorPlan, Piece]]:
        return [(plan, piece) for plan in self.tensors for piece in plan.pieces if piece.owner == owner]

    @cached_property
    def owners(self) -> list[int]:
        return sorted({piece.owner for plan in self.tensors for piece in plan.pieces})

    def nbytes(self, owner: int) -> int:
        key = ("bytes", owner)
        if key not in self._memo:
            self._memo[key] = sum(piece.numel * plan.dtype.itemsize for plan, piece in self.pieces_of(owner))
        return int(self._memo[key])

    def messages(self, owner: int) -> list[list[tuple[TensorPlan, Piece]]]:
        """What ``owner`` sends of this bucket, message by message: a piece of :data:`SMALL_PIECE_BYTES` or more
        alone (from where the owner keeps it, into where it goes), consecutive smaller ones packed into one message
        of up to :data:`PACK_BYTES` (a message costs about what copying a MiB does)."""
        key = ("messages", owner, SMALL_PIECE_BYTES, PACK_BYTES)
        if key not in self._memo:
            self._memo[key] = self._group_messages(owner)
        found: list[list[tuple[TensorPlan, Piece]]] = self._memo[key]
        return found

    @cached_property
    def _memo(self) -> dict[tuple[Any, ...], Any]:
        """What is worked out once per bucket (a plan's buckets serve every update)."""
        return {}

    def _group_messages(self, owner: int) -> list[list[tuple[TensorPlan, Piece]]]:
        found: list[list[tuple[TensorPlan, Piece]]] = []
        current: list[tuple[TensorPlan, Piece]] | None = None  # the pack open for more small pieces
        packed = 0
        for plan, piece in self.pieces_of(owner):
            nbytes = piece.numel * plan.dtype.itemsize
            if nbytes >= SMALL_PIECE_BYTES:
                found.append([(plan, piece)])
                current = None  # a pack does not span a large piece: the order on the wire is the plan's
                continue
            if current is None or packed + nbytes > PACK_BYTES:
                current, packed = [], 0
                found.append(current)
            current.append((plan, piece))
            packed += nbytes
        return found


#: Pieces under this size travel packed with their neighbours (:meth:`Bucket.messages`), in messages up to PACK_BYTES.
SMALL_PIECE_BYTES = 1 << 20
PACK_BYTES = 4 << 20


def pack(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Several pieces' values as one message: their bytes one after another."""
    return torch.cat([v.reshape(-1).view(torch.uint8) for v in values])


class Landing:
    """Where a bucket's pieces are received: straight into each tensor's destination where a shard lies there in one
    run (a replicated tensor, a split along its first dimension), else into the shard's own buffer, which
    :meth:`finish` copies into place once every piece is in. ``post(owner, tensor)`` starts the receive (or, on the
    owner, the send) of one piece and returns its work; ``own(plan, piece)`` is this rank's own values of a piece it
    sends (None where it sends none)."""

    def __init__(self, bucket: Bucket, destination: Any, post: Any, own: Any = None, scratch: Scratch | None = None):
        self.bucket, self.destinations = bucket, {plan.name: destination(plan) for plan in bucket.tensors}
        if scratch is not None:
            scratch.reset()
        self._apart: list[tuple[TensorPlan, int, torch.Tensor]] = []
        self._packs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._sent: list[torch.Tensor] = []
        targets: dict[tuple[str, Piece], torch.Tensor] = {}
        for plan in bucket.tensors:
            flat = self.destinations[plan.name].view(-1)
            for shard, numel, base in plan.runs:
                if base is not None:
                    target = flat[base:base + numel]
                else:
                    target = (scratch.take(numel, plan.dtype, flat.device) if scratch is not None else
                              torch.empty(numel, dtype=plan.dtype, device=flat.device))
                    self._apart.append((plan, shard, target))
                for piece in plan.pieces:
                    if piece.shard == shard:
                        targets[(plan.name, piece)] = target[piece.start:piece.stop]
        self.works = []
        for owner in bucket.owners:
            for message in bucket.messages(owner):
                into = [targets[(plan.name, piece)] for plan, piece in message]
                mine = [own(plan, piece) for plan, piece in message] if own is not None else []
                if mine and mine[0] is not None:  # this rank sends it: its own targets from its own values
                    for target, values in zip(into, mine):
                        target.copy_(values)
                    values = mine[0] if len(mine) == 1 else pack(mine)
                    self._sent.append(values)  # alive until its work is done
                    self.works.append(post(owner, values))
                elif len(into) == 1:
                    self.works.append(post(owner, into[0]))
                else:
                    nbytes = sum(t.numel() * t.element_size() for t in into)
                    buffer = (scratch.take(nbytes, torch.uint8, into[0].device) if scratch is not None else
                              torch.empty(nbytes, dtype=torch.uint8, device=into[0].device))
                    self._packs.append((buffer, into))
                    self.works.append(post(owner, buffer))

    def finish(self) -> dict[str, torch.Tensor]:
        """Wait for every piece; the bucket's full tensors."""
        for work in self.works:
            if work is not None:
                work.wait()
        for buffer, into in self._packs:
            position = 0
            for target in into:
                nbytes = target.numel() * target.element_size()
                target.view(-1).view(torch.uint8).copy_(buffer[position:position + nbytes])
                position += nbytes
        for plan, shard, values in self._apart:
            _place(plan.layout, shard, values, self.destinations[plan.name])
        return self.destinations


class Scratch:
    """Memory a landing's shard buffers are cut from, kept from one bucket (and update) to the next: fresh memory
    for each would be paged in anew every time, which costs as much as the copy it holds."""

    def __init__(self) -> None:
        self._memory: torch.Tensor | None = None
        self._used = 0
        self._wanted = 0

    def reset(self) -> None:
        self._used = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        size = -(-numel * dtype.itemsize // 64) * 64
        memory = self._memory
        if self._used == 0 and (memory is None or memory.device != device or memory.numel() < max(self._wanted, size)):
            # A bucket's first buffer: room for as much as any bucket has needed so far.
            self._wanted = max(self._wanted, size)
            memory = self._memory = torch.empty(self._wanted, dtype=torch.uint8, device=device)
        if memory is not None and memory.device == device and self._used + size <= memory.numel():
            values = memory[self._used:self._used + numel * dtype.itemsize].view(dtype)
            self._used += size
            return values
        self._wanted = max(self._wanted, self._used + size)  # the next bucket has room for it
        return torch.empty(numel, dtype=dtype, device=device)


def _run_start(layout: TPLayout, shard: int) -> int | None:
    """Where shard ``shard`` starts in the full tensor flattened, if its elements lie there in one run; else None."""
    if layout.is_replicated:
        return 0
    logical = layout.logical_shape
    pieces = [(offset, length) for offset, length in layout.rank_pieces(shard) if length]
    if math.prod(logical[:layout.dim]) != 1 or len(pieces) > 1:
        return None
    return pieces[0][0] * math.prod(logical[layout.dim + 1:]) if pieces else 0


def _place(layout: TPLayout, shard: int, values: torch.Tensor, full: torch.Tensor) -> None:
    """Copy shard ``shard``'s values into the full tensor, where the layout put them."""
    local = values.view(layout.local_view_shape(shard))
    view = full.view(layout.logical_shape)
    position = 0
    for offset, length in layout.rank_pieces(shard):
        if length:
            view.narrow(layout.dim, offset, length).copy_(local.narrow(layout.dim, position, length))
        position += length


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
    return [Bucket(tuple(group)) for group in groups if group]
