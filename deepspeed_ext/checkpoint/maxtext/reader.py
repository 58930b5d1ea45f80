"""The source behind ``from-maxtext`` (and ``to-hf``, ``inspect``, ``verify`` of a MaxText checkpoint): a MaxText
Orbax checkpoint read back as HF-named fp32 tensors, each undone from MaxText's layout."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deepspeed_ext.checkpoint import orbax_private
from deepspeed_ext.checkpoint.families import LAYER, LAYERS, Family, Rule
from deepspeed_ext.checkpoint.fingerprint import Fingerprints
from deepspeed_ext.checkpoint.locate import MAXTEXT, maxtext_items
from deepspeed_ext.checkpoint.maxtext.names import (CUSTOM_METADATA, FAMILY_KEY, FINGERPRINTS_KEY, ITEM,
                                                    METADATA, METADATA_KEY, MODEL_AUX_KEY, MODEL_AUX_MODEL,
                                                    MODEL_CONFIG_KEY, MOMENT_PREFIX, OPT_STATE_KEY, OPTIMIZER_COUNT,
                                                    PARAMS_COLLECTION, PARAMS_PREFIX, STEP_DIR, STEP_KEY,
                                                    STEP_METADATA)
from deepspeed_ext.checkpoint.maxtext.orbax_io import restore_leaf, restore_leaves
from deepspeed_ext.checkpoint.maxtext.plan import layer_blocks, rule_blocks
from deepspeed_ext.checkpoint.maxtext.settings import maxtext_settings, settings_text
from deepspeed_ext.checkpoint.maxtext.transforms import TRANSFORMS, ModelDims, from_maxtext, join_parts
from deepspeed_ext.checkpoint.source import CheckpointSource, OpenOptions, SourceInfo
from deepspeed_ext.checkpoint.states import ADAM_STATES, MASTER_WEIGHTS, STEP
from deepspeed_ext.errors import CheckpointError, MissingConfigError, first_line

if TYPE_CHECKING:  # torch only where tensors are handed over
    from deepspeed_ext.checkpoint.tensor import LogicalTensor
    from deepspeed_ext.module_inject.layout import TPLayout


#: Where one part of an HF tensor comes from: its rule, the leaf, the layer's index on the leaf's stack axes (None:
#: unstacked), and which of the rule's sources it is.
_Part = tuple[Rule, str, tuple[int, ...] | None, int]


def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`): the checkpoint with its HF config
    and family, given, else what to-maxtext recorded."""
    from deepspeed_ext.checkpoint.families import get_family, infer_family, require_maxtext
    items = maxtext_items(path)
    if items is None:
        raise CheckpointError(f"{path}: not a MaxText (Orbax) checkpoint (no _METADATA, no <step>/items)")
    stored = stored_model_info(items)
    if options.model_config is not None:
        config = dict(options.model_config)
    elif stored.get(MODEL_CONFIG_KEY):
        config = stored[MODEL_CONFIG_KEY]
    else:
        raise MissingConfigError(f"{items}: no model config recorded with this MaxText checkpoint (it was not written "
                                 "by deepspeed-ext); pass --config config.json (the model's HF config)")
    family_name = options.family or stored.get(FAMILY_KEY)
    family = require_maxtext(get_family(family_name) if family_name else infer_family(config, str(items)), str(items))
    # The fingerprints to-maxtext recorded describe what a read returns with the recorded config and family;
    # another config (--config, --family) reads the arrays differently, so the record does not apply.
    recorded = stored.get(FINGERPRINTS_KEY)
    as_written = config == stored.get(MODEL_CONFIG_KEY) and family.name == stored.get(FAMILY_KEY)
    fingerprints = (Fingerprints.from_json(recorded, f"{items.parent / STEP_METADATA} ({CUSTOM_METADATA})")
                    if recorded is not None and as_written else None)
    return MaxTextCheckpoint(items, family, config, given=path, fingerprints=fingerprints)


#: Restored leaves kept beyond the last six while their sum fits, and read together (see ``MaxTextCheckpoint._leaf``).
LEAF_CACHE_BYTES = 256 << 20
LEAF_BATCH_BYTES = 64 << 20


class MaxTextCheckpoint:
    """A MaxText Orbax checkpoint (``<root>/<step>/items``) as a stream of HF-named fp32 tensors.

    Arrays are read one leaf at a time through Orbax's partial restore; a scanned stack stays cached
    while its layers are handed out, with its two moments' stacks (and, for a fused expert tensor, the
    stacks of its other half), so memory stays at a few of the largest arrays. It plugs into the universal writer like a
    DeepSpeed source with a single TP rank. When the checkpoint has optax adamw's state (MaxText's
    default optimizer) its moments and count become the universal ``exp_avg`` / ``exp_avg_sq`` / step;
    otherwise the optimizer state is fresh (zero moments, step 0).
    """

    def __init__(self, items: str | Path, family: Family, model_config: Mapping[str, Any],
                 given: str | Path | None = None, fingerprints: Fingerprints | None = None):
        """``given``: the path the user named (the root, a step or the item directory); errors name it.
        ``fingerprints``: what to-maxtext recorded of the tensors a read returns, checked by the writers."""
        import orbax.checkpoint as ocp
        self.items = Path(items).absolute()
        self.given = Path(given) if given is not None else self.items
        if not (self.items / METADATA).is_file():
            hint = " (point at <root>/0/items)" if (self.items / STEP_DIR / ITEM / METADATA).is_file() else ""
            raise CheckpointError(f"{self.items}: not an Orbax checkpoint item directory (no _METADATA){hint}")
        self.tag_dir = self.items
        self.fingerprints = fingerprints
        self.family = family
        self.model_config = dict(model_config)
        self.dims = ModelDims.from_config(model_config, source="--config")
        self._checkpointer = orbax_private.leaf_checkpointer()
        try:
            metadata = ocp.PyTreeCheckpointer().metadata(self.items)
            if metadata is None or metadata.item_metadata is None:
                raise ValueError("_METADATA is unreadable or empty")
            self._tree = metadata.item_metadata.tree
            flat = ocp.tree.to_flat_dict(self._tree, sep="/")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{self.items / METADATA}: cannot read the Orbax metadata: "
                                  f"{first_line(exc)}") from exc
        # Keys: the leaf under the tree's "params", "<collection>/<path>" ("params/decoder/...").
        params_prefix = "/".join(PARAMS_PREFIX) + "/"
        self.stored = {name[len(params_prefix):]: tuple(m.shape) for name, m in flat.items()
                       if name.startswith(params_prefix)}
        self.stored_dtypes = {name[len(params_prefix):]: str(m.dtype) for name, m in flat.items()
                              if name.startswith(params_prefix)}
        # MaxText's full train state keeps the variables outside params (DeepSeek's router bias) under
        # nnx_aux/model/<path>; a checkpoint MaxText wrote has them only there.
        aux_prefix = f"{MODEL_AUX_KEY}/{MODEL_AUX_MODEL}/"
        self._aux = {name[len(aux_prefix):]: m for name, m in flat.items() if name.startswith(aux_prefix)}
        if not any(name.startswith(f"{PARAMS_COLLECTION}/") for name in self.stored):
            raise CheckpointError(f"{self.items}: no params/params tree in the Orbax metadata")
        self._stored_paths = set(flat)
        self.scan_layers = self._is_scanned()
        self._sources = self._plan()
        moments = {state: {name[len("/".join(prefix)) + 1:] for name in flat if name.startswith("/".join(prefix) + "/")}
                   for state, prefix in MOMENT_PREFIX.items()}
        self.has_optimizer = all(moments.values())
        #: "adamw" (optax adamw's state, carried), "none" (parameters only) or "other" (a train state whose
        #: optimizer is not adamw: MaxText's sgd, whose state is its counts alone, muon or adam_pax; not carried).
        self.optimizer_kind = "adamw" if self.has_optimizer else (
            "other" if any(name.startswith(f"{OPT_STATE_KEY}/") for name in flat) else "none")
        optimized = {name for name in self.stored if name.startswith(f"{PARAMS_COLLECTION}/")}
        if self.has_optimizer and any(names != optimized for names in moments.values()):
            raise CheckpointError(f"{self.items}: opt_state mu/nu do not mirror params (not optax adamw's state?)")
        self.step = self._read_scalar((STEP_KEY, ))
        self.optimizer_step = self._read_scalar(OPTIMIZER_COUNT) if self.has_optimizer else 0
        self._cache: dict[tuple[str, ...], np.ndarray] = {}
        self._cache_bytes = 0  # what the cache holds

    def _is_scanned(self) -> bool:
        """Whether the layers are stored stacked: a stack of the scanned layout is there. A depth the scanned
        layout cannot hold (gpt-oss's odd layer counts) can only have been written unscanned."""
        try:
            blocks = layer_blocks(self.family, self.dims, True)
        except CheckpointError:
            return False
        stacks = {block.path for block in blocks if block.stacked}
        return any(f"/{stack}/" in f"/{name}" for name in self.stored for stack in stacks)

    @property
    def read_paths(self) -> list[Path]:
        """The checkpoint: the step directory (the item, its metadata) and, when the step sits in an Orbax
        checkpoint manager's root (``<root>/<step>/items``), the root with its manifest."""
        from deepspeed_ext.checkpoint import output
        step = self.items.parent
        return output.read_paths(step.parent if step.name.isdigit() else step)

    def _restore(self, path: tuple[str, ...], restore_type: type, dtype: Any = None) -> Any:
        return restore_leaf(self._checkpointer, self.items, self._tree, path, restore_type, dtype)

    def _read_scalar(self, path: tuple[str, ...]) -> int:
        try:
            return int(np.asarray(self._restore(path, int)))
        except (KeyError, IndexError, TypeError, ValueError, FileNotFoundError):
            return 0  # params-only checkpoints need no step

    def _plan(self) -> dict[str, list[_Part]]:
        """HF name -> the (rule, leaf, layer's index in a stack, which of the rule's sources) its parts come from,
        in rule order."""
        sources: dict[str, list[_Part]] = {}
        #: Where a leaf's weights sit in the tree when not at params/<leaf> (nnx_aux, above).
        self._tree_paths: dict[str, tuple[str, ...]] = {}
        blocks = layer_blocks(self.family, self.dims, self.scan_layers)
        for rule in self.family.rules_for(self.dims.tied, self.dims.config):
            places: list[tuple[str, str, tuple[int, ...] | None, int]] = []
            if not rule.per_layer:
                places.extend((hf, f"{rule.collection}/{rule.path}", None, part)
                              for part, hf in enumerate(rule.sources))
            for block in rule_blocks(rule, blocks) if rule.per_layer else []:
                leaf = f"{rule.collection}/{rule.path.replace(LAYERS, block.path)}"
                stack = block.stack or (len(block.layers), )
                for position, layer in enumerate(block.layers):
                    index = tuple(int(i) for i in np.unravel_index(position, stack)) if block.stacked else None
                    places.extend((hf.replace(LAYER, str(layer)), leaf, index, part)
                                  for part, hf in enumerate(rule.sources))
            for hf, leaf, index, part in places:
                path = leaf.split("/", 1)[1]
                if leaf not in self.stored and rule.collection != PARAMS_COLLECTION and path in self._aux:
                    self.stored[leaf] = tuple(self._aux[path].shape)
                    self.stored_dtypes[leaf] = str(self._aux[path].dtype)
                    self._tree_paths[leaf] = (MODEL_AUX_KEY, MODEL_AUX_MODEL, *path.split("/"))
                if leaf not in self.stored:
                    raise CheckpointError(f"{self.items}: MaxText leaf {leaf!r} (for {hf}) is missing; wrong "
                                          f"--family ({self.family.name}) or config?")
                sources.setdefault(hf, []).append((rule, leaf, index, part))
        used = {leaf for parts in sources.values() for _, leaf, _, _ in parts}
        #: The optimized leaves in the order the plan reads them (restored together, see ``_leaf``).
        self._leaf_order = list(dict.fromkeys(leaf for parts in sources.values() for _, leaf, _, _ in parts
                                              if leaf not in self._tree_paths))
        self._leaf_position = {leaf: i for i, leaf in enumerate(self._leaf_order)}
        extra = sorted(set(self.stored) - used)
        if extra:
            raise CheckpointError(f"{self.items}: {len(extra)} MaxText arrays have no place in family "
                                  f"{self.family.name!r} (e.g. {extra[:3]}); wrong --family or config?")
        return sources

    def _leaf(self, path: tuple[str, ...], prefix: tuple[str, ...] = (), leaf: str | None = None) -> np.ndarray:
        """One restored leaf (fp32), from a least-recently-used cache. It always keeps the last six (a weight and
        its two moments, each possibly split in two: fused experts), so a stack serves all its layers from one
        restore, and more while they fit in ``LEAF_CACHE_BYTES``. A miss of ``leaf`` under ``prefix`` (a state's
        subtree) restores the leaves after it in the plan's order with it, up to ``LEAF_BATCH_BYTES``: each Orbax
        restore costs milliseconds whatever it reads, and small models have hundreds of small leaves."""
        array = self._cache.pop(path, None)
        if array is None:
            wanted = [path]
            if leaf is not None:
                budget = LEAF_BATCH_BYTES - 4 * math.prod(self.stored[leaf])
                for following in self._leaf_order[self._leaf_position[leaf] + 1:]:
                    budget -= 4 * math.prod(self.stored[following])
                    if budget < 0:
                        break
                    following_path = (*prefix, *following.split("/"))
                    # Under a moment's prefix only the optimized leaves are there (not DeepSeek's router bias).
                    if following_path not in self._cache and "/".join(following_path) in self._stored_paths:
                        wanted.append(following_path)
            for restored_path, value in restore_leaves(self._checkpointer, self.items, self._tree, wanted,
                                                       np.ndarray, np.float32).items():
                self._cache[restored_path] = np.asarray(value, dtype=np.float32)
                self._cache_bytes += self._cache[restored_path].nbytes
            array = self._cache.pop(path)
        self._cache[path] = array
        while len(self._cache) > 6 and self._cache_bytes > LEAF_CACHE_BYTES:
            self._cache_bytes -= self._cache.pop(next(iter(self._cache))).nbytes
        return array

    def _hf_shape(self, parts: list[_Part]) -> tuple[int, ...]:
        shapes = []
        for rule, leaf, index, part in parts:
            shape = self.stored[leaf]
            if index is not None:
                shape = shape[:rule.scan_axis] + shape[rule.scan_axis + len(index):]
            shape = TRANSFORMS[rule.kind].hf_shape(shape)
            if len(rule.sources) > 1:  # this tensor's rows of the fused ones
                shape = (self._fused_rows(rule)[part], *shape[1:])
            shapes.append(shape)
        axis = TRANSFORMS[parts[0][0].kind].join_axis
        if axis is None:
            return shapes[0]
        axis %= len(shapes[0])
        return tuple(sum(s[axis] for s in shapes) if i == axis else d for i, d in enumerate(shapes[0]))

    def hf_tensor(self, name: str, state: str = MASTER_WEIGHTS) -> np.ndarray:
        """The full fp32 HF tensor ``name`` (or one of its Adam moments), undone from MaxText's layout."""
        prefix = PARAMS_PREFIX if state == MASTER_WEIGHTS else MOMENT_PREFIX[state]
        pieces = []
        for rule, leaf, index, part in self._sources[name]:
            if state != MASTER_WEIGHTS and rule.collection != PARAMS_COLLECTION:
                # Outside the optimizer (DeepSeek's router bias): no moments, as a never-stepped Adam has.
                pieces.append(np.zeros(self._hf_shape([(rule, leaf, index, part)]),
                                       np.int64 if TRANSFORMS[rule.kind].integer else np.float32))
                continue
            where = self._tree_paths.get(leaf) if state == MASTER_WEIGHTS else None
            array = self._leaf(where) if where else self._leaf((*prefix, *leaf.split("/")), prefix, leaf)
            for i in index or ():  # each take drops the stack axis it indexes: the next one is at the same axis
                array = np.take(array, i, axis=rule.scan_axis)
            piece = from_maxtext(rule.kind, np.ascontiguousarray(array), self.dims, self.family, state)
            if len(rule.sources) > 1:  # this tensor's rows of the fused ones
                bounds = np.cumsum((0, *self._fused_rows(rule)))
                piece = piece[bounds[part]:bounds[part + 1]]
            pieces.append(piece)
        return np.ascontiguousarray(join_parts(self._sources[name][0][0].kind, pieces))

    def _fused_rows(self, rule: Rule) -> tuple[int, ...]:
        """The rows of each of the HF tensors ``rule`` fuses into its leaf."""
        rows = TRANSFORMS[rule.kind].fused_rows
        if rows is None:
            raise CheckpointError(f"internal: transform {rule.kind!r} of fused {rule.sources} does not split them")
        return rows(self.dims)

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        from deepspeed_ext.module_inject.layout import TPLayout
        return {name: TPLayout.replicated(self._hf_shape(parts), 1) for name, parts in self._sources.items()}

    @cached_property
    def info(self) -> SourceInfo:
        # Without optax state there are only weights: the resuming optimizer starts fresh.
        states = (MASTER_WEIGHTS, *ADAM_STATES, STEP) if self.has_optimizer else (MASTER_WEIGHTS, )
        return SourceInfo(format=MAXTEXT, given=self.given, path=self.items, layouts=self.layouts, states=states,
                          global_step=self.step, model_config=self.model_config,
                          versions={"source": f"maxtext ({self.family.name})"}, fingerprints=self.fingerprints)

    def tensors(self) -> Iterator[LogicalTensor]:
        import torch

        from deepspeed_ext.checkpoint.model_config import torch_dtype
        from deepspeed_ext.checkpoint.tensor import LogicalTensor
        # Weights first, then each moment, so a cached scanned stack serves all its layers in a row.
        for name, layout in self.layouts.items():

            def loader(state: str, name: str = name) -> Any:
                if state == STEP:
                    return self.optimizer_step
                return torch.from_numpy(self.hf_tensor(name, state))

            rule, leaf = self._sources[name][0][:2]
            # Indices (DeepSeek-V4's hash-routing table) come back in the HF buffer's int64, whatever MaxText kept.
            dtype = torch.int64 if TRANSFORMS[rule.kind].integer else torch_dtype(self.stored_dtypes[leaf])
            yield LogicalTensor(name=name, shape=layout.shape, layout=layout, states=self.info.states, loader=loader,
                                dtype=dtype)

    def raise_if_damaged(self) -> None:
        """Nothing to check as it streams: this format's files are checked by ``verify`` (a manifest, where
        deepspeed-ext wrote them)."""

    def summary(self) -> dict[str, Any]:
        return {
            "kind": MAXTEXT,
            "path": str(self.items),
            "family": self.family.name,
            "model_type": self.model_config.get("model_type"),
            "scan_layers": self.scan_layers,
            "arrays": len(self.stored),
            "tensor_dtypes": sorted(set(self.stored_dtypes.values())),
            "global_steps": self.step,
            "state": self.state_description,
            "optimizer": "optax adamw (mu, nu)" if self.has_optimizer else "none",
            "optimizer_step": self.optimizer_step if self.has_optimizer else None,
            "num_parameters": sum(math.prod(layout.shape) for layout in self.layouts.values()),
            "maxtext_settings": self._settings_text(),
        }

    @property
    def state_description(self) -> str:
        """What the checkpoint holds, and which MaxText setting reads it."""
        return {"adamw": "full train state (parameters, optax adamw's mu/nu, step): MaxText's load_full_state_path",
                "none": "parameters only: MaxText's load_parameters_path",
                "other": "full train state whose optimizer is not optax adamw (MaxText's opt_type sgd, muon or "
                         "adam_pax?): parameters and step are read, its optimizer state is not"}[self.optimizer_kind]

    def require_optimizer(self) -> None:
        """Refuse, in one line, a checkpoint without optax adamw's state where its optimizer must be carried."""
        if not self.has_optimizer:
            raise CheckpointError(f"{self.given}: {self.state_description}; there is no Adam state to carry "
                                  "(--with-optimizer): drop it, and the resumed run starts its optimizer fresh")

    def _settings_text(self) -> str:
        try:
            return settings_text(maxtext_settings(self.family, self.model_config, self.scan_layers))
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            return f"unknown ({first_line(exc)})"


def stored_model_info(items: str | Path) -> dict[str, Any]:
    """What to-maxtext recorded in the step's custom metadata (family, HF model config), or {}."""
    import orbax.checkpoint as ocp
    step_dir = Path(items).absolute().parent
    try:
        custom = ocp.StandardCheckpointer().metadata(step_dir).custom_metadata or {}
    except (FileNotFoundError, ValueError, KeyError):
        return {}
    return dict(custom.get(METADATA_KEY) or {})
