"""What upstream DeepSpeed records about AutoTP layouts, read into :class:`TPLayout` objects: a parameter's
``ds_autotp_universal_checkpoint_meta`` (DeepSpeed >= 0.18.9), and the model-level ``universal_checkpoint_info`` a
checkpoint carries with each rank's local shapes; and the name helpers that report on layouts.

Plain data in, layouts out: no torch module, no process group. The checkpoint readers use it to read a checkpoint
saved without deepspeed-ext; :mod:`~deepspeed_ext.module_inject.autotp` uses it on a live model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from deepspeed_ext.errors import LayoutError, MissingMetadataError
from deepspeed_ext.module_inject.layout import TPLayout


def layout_from_upstream_meta(meta: Mapping[str, Any], tp_size: int) -> TPLayout:
    """Translate DeepSpeed's per-parameter ``ds_autotp_universal_checkpoint_meta`` into a TPLayout."""
    if meta.get("unsupported_reason"):
        raise LayoutError(f"DeepSpeed marks this layout unsupported: {meta['unsupported_reason']}")
    original = tuple(meta.get("original_shape") or meta.get("logical_shape") or ())
    logical = tuple(meta.get("logical_shape") or original)
    dim = meta.get("partition_dim")
    if meta.get("replicated") or dim is None:
        return TPLayout.replicated(original, tp_size)
    ptype = meta.get("partition_type") or "column"
    widths = meta.get("sub_param_shard_widths")
    if widths:
        sub_sizes = tuple(meta.get("sub_param_sizes") or (sum(w) for w in widths))
        return TPLayout.sub_params(original,
                                   tp_size,
                                   dim,
                                   sub_sizes,
                                   widths,
                                   partition_type=ptype,
                                   view_shape=logical,
                                   role="sub_params" if len(sub_sizes) > 1 else None)
    sizes = meta.get("partition_sizes")
    if sizes is None:  # legacy (< UC 0.4) metadata: even split, divisibility required
        total = logical[dim]
        if total % tp_size:
            raise LayoutError(f"legacy metadata implies an even split of {total} over {tp_size} ranks")
        sizes = (total // tp_size, ) * tp_size
    return TPLayout.sub_params(original,
                               tp_size,
                               dim, (logical[dim], ), (tuple(sizes), ),
                               partition_type=ptype,
                               view_shape=logical,
                               role=None)


def unsharded_weights(layouts: Mapping[str, TPLayout], min_ndim: int = 2) -> list[str]:
    """Parameters of at least ``min_ndim`` dimensions that a TP>1 model keeps whole on every TP rank.

    AutoTP shards ``nn.Linear`` (and embedding) weights only; anything else, such as the fused 3-D expert
    stacks transformers uses for MoE layers, stays replicated. It is converted and restored correctly
    as such, but costs memory and compute on every TP rank, so users are told which ones.
    """
    return [name for name, layout in layouts.items()
            if layout.tp_size > 1 and layout.is_replicated and len(layout.shape) >= min_ndim]


def name_patterns(names: Iterable[str]) -> list[str]:
    """``model.layers.0.x`` and ``model.layers.1.x`` as one ``model.layers.*.x`` (order kept)."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))


# --------------------------------------------------------------------------- model-level UC info
class _PatternSet:
    """Regexes from ``universal_checkpoint_info``; exact-name patterns are looked up in O(1)."""

    def __init__(self, patterns: Iterable[str]):
        self.exact: set[str] = set()
        self.regexes: list[re.Pattern[str]] = []
        for pattern in patterns or ():
            literal = _exact_name(pattern)
            if literal is not None:
                self.exact.add(literal)
            else:
                self.regexes.append(re.compile(pattern))

    def match(self, name: str) -> bool:
        return name in self.exact or any(r.match(name) for r in self.regexes)


def _exact_name(pattern: str) -> str | None:
    """The literal name if ``pattern`` is ``^<re.escape(name)>$`` (what AutoTP publishes), else None."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    body = pattern[1:-1]
    literal = re.sub(r"\\(.)", r"\1", body)
    return literal if re.escape(literal) == body else None


def layouts_from_universal_checkpoint_info(info: Mapping[str, Any],
                                           local_shapes: Mapping[str, Sequence[Sequence[int] | None]],
                                           source: str = "checkpoint") -> dict[str, TPLayout]:
    """Rebuild every parameter's layout from upstream's model-level UC info plus per-rank local shapes.

    ``local_shapes[name][r]`` is the shape TP rank ``r`` saved (``param_shapes`` of its model-states
    file), None where the rank saved none: an empty shard (a rank beyond the KV-head count), which has
    width 0 along the split dimension. Row patterns split dim 1, replicated patterns keep rank 0's copy,
    sub-param patterns use the published per-rank widths, everything else is a dim-0 (column) split, as
    upstream's converter assumes.
    """
    if not info:
        raise MissingMetadataError(f"{source}: no universal_checkpoint_info")
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    replicated = _PatternSet(info.get("tp_replicated_parameter_patterns") or ())
    row = _PatternSet(info.get("parameter_with_row_parallelism_patterns") or ())
    vocab = _PatternSet(info.get("vocabulary_parameter_patterns") or ())
    unsupported_set = {pattern: _PatternSet([pattern]) for pattern in unsupported}
    widths_by_pattern = info.get("sub_param_shard_widths") or {}
    sub_params = []
    for entry in info.get("parameter_with_sub_params") or []:
        entry = entry if isinstance(entry, Mapping) else vars(entry)
        for pattern in entry["patterns"]:
            sub_params.append((_PatternSet([pattern]), pattern, entry))

    layouts = {}
    for name, saved in local_shapes.items():
        tp = len(saved)
        for pattern, matcher in unsupported_set.items():
            if matcher.match(name):
                raise LayoutError(f"{source}: parameter {name!r} has a layout DeepSpeed marks unsupported: "
                                  f"{unsupported[pattern]}")
        some = next(tuple(s) for s in saved if s is not None)
        if replicated.match(name) or tp == 1:
            layouts[name] = TPLayout.replicated(some, tp)
            continue
        sub = next(((pattern, entry) for matcher, pattern, entry in sub_params if matcher.match(name)), None)
        if sub is not None:
            pattern, entry = sub
            shapes = [tuple(s) if s is not None else (0, *some[1:]) for s in saved]
            layouts[name] = _sub_param_layout_from_info(name, shapes, entry, widths_by_pattern.get(pattern), source)
            continue
        dim = 1 if row.match(name) else 0
        shapes = [tuple(s) if s is not None else tuple(0 if d == dim else n for d, n in enumerate(some))
                  for s in saved]
        full = list(shapes[0])
        full[dim] = sum(s[dim] for s in shapes)
        layouts[name] = TPLayout.split(full,
                                       tp,
                                       dim, [s[dim] for s in shapes],
                                       "row" if dim == 1 else "column",
                                       role="vocab" if vocab.match(name) else None)
    return layouts


def _sub_param_layout_from_info(name: str, shapes: Sequence[tuple[int, ...]], entry: Mapping[str, Any],
                                widths: Sequence[Sequence[int]] | None, source: str) -> TPLayout:
    tp = len(shapes)
    spec = list(entry["shape"])
    dim = int(entry["partition_dim"])
    sizes = spec[dim]
    if isinstance(sizes, int):  # a count of equal sub-params (pre-0.4 metadata)
        total = sum(s[dim] for s in shapes) if len(spec) == len(shapes[0]) else None
        if total is None or total % sizes:
            raise LayoutError(f"{source}: cannot resolve sub-param sizes of {name!r} from spec {spec}")
        sizes = [total // sizes] * sizes
    sizes = [int(s) for s in sizes]
    if widths is None:
        if any(s % tp for s in sizes):
            raise MissingMetadataError(f"{source}: {name!r} has uneven sub-params {sizes} over {tp} ranks but no "
                                       "sub_param_shard_widths")
        widths = [[s // tp] * tp for s in sizes]
    numel = sum(math.prod(s) for s in shapes)
    view = list(spec)
    view[dim] = sum(sizes)
    known = 1
    for d in view:
        if d != -1:
            known *= int(d)
    view = [numel // known if d == -1 else int(d) for d in view]
    last = shapes[0][-1]
    physical = (numel, ) if len(shapes[0]) == 1 else (numel // last, last)
    return TPLayout.sub_params(physical, tp, dim, sizes, widths, view_shape=view, role="sub_params")
