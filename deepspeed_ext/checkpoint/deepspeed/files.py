"""Which files a DeepSpeed tag directory holds, and the memory-mapped, cached reading of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError


def resolve_tag_dir(path: str | Path, tag: str | None = None, latest_file: str = keys.LATEST) -> Path:
    """The tag directory from a save dir (+ optional tag, else its ``latest`` file) or a tag dir itself.

    A DeepSpeed tag is read only when it is complete (:func:`~deepspeed_ext.checkpoint.commit.require_complete`):
    a save that never finished, or whose files disagree with its commit marker, is refused in one line that
    names the newest complete tag where there is one."""
    return _complete(find_tag_dir(path, tag, latest_file))


def find_tag_dir(path: str | Path, tag: str | None = None, latest_file: str = keys.LATEST) -> Path:
    """The tag directory :func:`resolve_tag_dir` reads, by the names alone (not yet checked complete): what the CLI
    checks before the libraries load, so a missing tag is said at once."""
    from deepspeed_ext.checkpoint import commit
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if commit.is_staging(path):
        commit.require_complete(path)
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(commit.unfinished_save_message(path, tag) or f"{tag_dir}: no such tag directory")
        return tag_dir
    if any(keys.MODEL_STATES_RE.match(p.name) or keys.ZERO3_MODEL_STATES_RE.match(p.name) for p in path.iterdir()):
        return path
    latest = path / latest_file
    if latest.is_file():
        tag = durable.read_pointer(latest)
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"{latest}: names tag {tag!r}, but {tag_dir} does not exist")
        return tag_dir
    unfinished = commit.unfinished_save_message(path)
    if unfinished is not None:
        raise CheckpointError(unfinished)
    raise CheckpointError(f"{path}: neither a tag directory (no mp_rank_*_model_states.pt) nor a save directory "
                          f"with a '{latest_file}' file; pass --tag")


def _load(path: Path) -> Any:
    """A file of the tag, memory-mapped (torch is imported here, not with this module: the CLI resolves a tag
    before the libraries load, so a wrong one is said at once)."""
    from deepspeed_ext.checkpoint import serialization
    return serialization.load(path)


def _complete(tag_dir: Path) -> Path:
    """``tag_dir``, once it is known to be complete; a universal tag (``zero/``) is checked by its manifest."""
    from deepspeed_ext.checkpoint import commit
    if not (tag_dir / keys.ZERO_DIR).is_dir():
        commit.require_complete(tag_dir)
    return tag_dir


@dataclass
class TagFiles:
    """The files of one tag directory, each loaded (memory-mapped) at most once.

    :meth:`scan` lists them; :meth:`degrees` then checks that they form a complete TP x DP set, agreeing with the
    degrees the model states record, and says which degrees that is (the files decide, the records check).
    """

    tag_dir: Path
    #: TP rank -> its model-states file (under ZeRO-3 the DP-0 one, which carries the same metadata).
    model_files: dict[int, Path]
    #: Every model-states file (under ZeRO-3 one per rank).
    all_model_files: list[Path]
    #: (TP rank, DP rank) -> optimizer file; empty without ZeRO, where the optimizer is in the model states.
    optim_files: dict[tuple[int, int], Path]
    #: ZeRO-3's per-rank model-states files are present (the weights themselves are partitioned).
    partitioned_weights: bool
    #: ZeRO-3: (TP rank, DP rank) -> model-states file; empty otherwise.
    model_grid: dict[tuple[int, int], Path] = field(default_factory=dict)
    #: (MoE layer, expert, TP rank) -> that expert's model-states file (its low-precision weights; AutoEP under
    #: ZeRO-1/2 writes them, its fp32 masters and moments are in the optimizer files).
    expert_files: dict[tuple[int, int, int], Path] = field(default_factory=dict)
    #: How this save names its optimizer files, ``{dp}`` and ``{tp}`` to fill in (to name a missing one).
    optim_template: str = "zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt"
    _model_states: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _optim_states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict, repr=False)
    _grid_states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def scan(cls, tag_dir: Path) -> TagFiles:
        """The files present, by rank. Refuses two files for one rank and files of two kinds (the model states of
        ZeRO-3 and of another stage, optimizer files with and without ``bf16_``): files of two saves."""
        names = sorted(p.name for p in tag_dir.iterdir())
        plain: dict[int, Path] = {}
        grid: dict[tuple[int, int], Path] = {}
        optim: dict[tuple[int, int], Path] = {}
        templates: dict[str, str] = {}  # optimizer-file naming -> the first file named so
        # DeepSpeed's older MoE layer without ZeRO keeps expert moments in files of their own, which are not read:
        # read without them, a conversion would drop the experts' optimizer state and still exit 0.
        expert_optim = next((name for name in names if keys.EXPERT_OPTIM_STATES_RE.match(name)), None)
        if expert_optim is not None:
            raise CheckpointError(f"{tag_dir / expert_optim}: an expert-parallel optimizer file of DeepSpeed's MoE "
                                  "layer without ZeRO; deepspeed-ext reads AutoEP checkpoints (ZeRO-1/2/3), not "
                                  "these, and reading the tag without them would drop the experts' state")
        experts: dict[tuple[int, int, int], Path] = {}
        for name in names:
            if m := keys.MODEL_STATES_RE.match(name):
                cls._add(plain, int(m.group(1)), tag_dir / name, f"TP rank {int(m.group(1))}")
            elif m := keys.EXPERT_MODEL_STATES_RE.match(name):
                layer, expert, tp = (int(g) for g in m.groups())
                cls._add(experts, (layer, expert, tp), tag_dir / name, f"layer {layer}, expert {expert}, TP rank {tp}")
            elif m := keys.ZERO3_MODEL_STATES_RE.match(name):
                tp, dp = int(m.group(2)), int(m.group(1))
                cls._add(grid, (tp, dp), tag_dir / name, f"dp_rank {dp}, mp_rank {tp:02d}")
            elif m := keys.OPTIM_STATES_RE.match(name):
                tp, dp = int(m.group(3)), int(m.group(2))
                cls._add(optim, (tp, dp), tag_dir / name, f"dp_rank {dp}, mp_rank {tp:02d}")
                separator = "_" if name.endswith("_optim_states.pt") else ""
                templates.setdefault(f"{m.group(1) or ''}zero_pp_rank_{{dp}}_mp_rank_{{tp:02d}}{separator}"
                                     "optim_states.pt", name)
        if not plain and not grid:
            raise CheckpointError(f"{tag_dir}: no mp_rank_*_model_states.pt files")
        if plain and grid:
            raise CheckpointError(f"{tag_dir}: both {plain[min(plain)].name} (ZeRO-0/1/2) and {grid[min(grid)].name} "
                                  "(ZeRO-3) are present: files of two checkpoints are mixed")
        if len(templates) > 1:
            first, second = sorted(templates.values())[:2]
            raise CheckpointError(f"{tag_dir}: optimizer files named two ways ({first} and {second}): files of two "
                                  "checkpoints are mixed")
        return cls(tag_dir=tag_dir,
                   model_files={tp: path for (tp, dp), path in sorted(grid.items()) if dp == 0} if grid else plain,
                   all_model_files=[tag_dir / name for name in names
                                    if keys.MODEL_STATES_RE.match(name) or keys.ZERO3_MODEL_STATES_RE.match(name)],
                   optim_files=optim,
                   partitioned_weights=bool(grid),
                   model_grid=grid,
                   expert_files=experts,
                   optim_template=next(iter(templates)) if templates else cls.optim_template)

    @staticmethod
    def _add(found: dict[Any, Path], key: Any, path: Path, what: str) -> None:
        if key in found:
            raise CheckpointError(f"{path.parent}: two files for {what}: {found[key].name} and {path.name}: files of "
                                  "two checkpoints are mixed")
        found[key] = path

    # ------------------------------------------------------------------ degrees
    def model_file_name(self, tp: int, dp: int = 0) -> str:
        """The name of TP rank ``tp``'s model-states file (under ZeRO-3, DP rank ``dp``'s)."""
        if self.partitioned_weights:
            return f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt"
        return f"mp_rank_{tp:02d}_model_states.pt"

    def optim_file_name(self, tp: int, dp: int) -> str:
        return self.optim_template.format(tp=tp, dp=dp)

    @property
    def tp_ranks(self) -> list[int]:
        """The TP ranks any file is for."""
        return sorted({*self.model_files, *(tp for tp, _ in self.model_grid), *(tp for tp, _ in self.optim_files)})

    @property
    def dp_ranks(self) -> list[int]:
        """The DP ranks any per-DP file (an optimizer file, a ZeRO-3 model-states file) is for; none under ZeRO-0."""
        return sorted({*(dp for _, dp in self.model_grid), *(dp for _, dp in self.optim_files)})

    def degrees(self, recorded_tp: int | None = None, recorded_dp: int | None = None,
                recorder: Path | None = None) -> tuple[int, int | None]:
        """``(TP, DP)`` from the files present, checked against what ``recorder`` (TP rank 0's model states)
        records: ``mp_world_size`` and ``dp_world_size``, None where it records none. DP is None where there are
        no per-DP files (ZeRO-0).

        Every TP rank must have its model-states file and the same DP ranks' optimizer files (ZeRO-3: model-states
        files too), ranks 0..n-1 with none missing. A file of a rank beyond a recorded degree (left from a save at
        another degree) is refused naming it; a missing file is refused naming the file that should be there; a
        record the files contradict is refused naming the record and the count of files.
        """
        tp_ranks, dp_ranks = self.tp_ranks, self.dp_ranks
        basis: list[str] = []  # what the expected degrees rest on, for the messages
        tp = self._degree("TP", tp_ranks, recorded_tp, recorder, basis, self._tp_files)
        dp = self._degree("DP", dp_ranks, recorded_dp, recorder, basis, self._dp_files) if dp_ranks else None
        degrees = f"TP={tp}" + (f" x DP={dp}" if dp is not None else "")
        dps = range(dp) if dp is not None else range(1)
        missing: list[tuple[str, str]] = []  # (file, what more to say when it is the first one named)
        if self.partitioned_weights:
            missing += [(self.model_file_name(t, d), "") for t in range(tp) for d in dps
                        if (t, d) not in self.model_grid]
        else:
            ranks = [t for t in range(tp) if t not in self.model_files]
            missing += [(self.model_file_name(t), f"; mp_rank files for TP ranks {ranks} are missing") for t in ranks]
        if self.optim_files:
            missing += [(self.optim_file_name(t, d), f"; the missing optimizer file for dp_rank {d}, mp_rank {t:02d}")
                        for t in range(tp) for d in dps if (t, d) not in self.optim_files]
        if missing:
            (name, more), count = missing[0], len(missing)
            why = "; ".join(basis) if basis else f"{degrees} from the files present"
            raise CheckpointError(f"{self.tag_dir}: {name} is missing ({why}{more}"
                                  f"{f'; {count} files missing in all' if count > 1 else ''})")
        return tp, dp

    def _tp_files(self, rank: int) -> list[Path]:
        return sorted([*(p for t, p in self.model_files.items() if t == rank),
                       *(p for (t, _), p in self.model_grid.items() if t == rank),
                       *(p for (t, _), p in self.optim_files.items() if t == rank)])

    def _dp_files(self, rank: int) -> list[Path]:
        return sorted([*(p for (_, d), p in self.optim_files.items() if d == rank),
                       *(p for (_, d), p in self.model_grid.items() if d == rank)])

    def _degree(self, what: str, ranks: list[int], recorded: int | None, recorder: Path | None, basis: list[str],
                files_of: Callable[[int], list[Path]]) -> int:
        """The ``what`` degree: as many as the files' highest rank says, or as recorded (then checked)."""
        present = max(ranks) + 1 if ranks else 1
        if recorded is None or recorder is None:
            return present
        kind = "optimizer files" if what == "DP" and self.optim_files else "files"
        count = f"{kind} for {len(ranks)} {what} rank{'s' if len(ranks) != 1 else ''} ({self._ranks_text(ranks)})"
        if present > recorded:
            beyond = next(rank for rank in ranks if rank >= recorded)
            raise CheckpointError(f"{self.tag_dir}: {files_of(beyond)[0].name} is beyond the {what} degree: "
                                  f"{recorder.name} says {what}={recorded}, but there are {count}: files of two "
                                  "checkpoints are mixed, or the model states are wrong")
        if present < recorded:
            basis.append(f"{recorder.name} says {what}={recorded}, but there are {count}")
        return recorded

    @staticmethod
    def _ranks_text(ranks: list[int]) -> str:
        if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
            return f"{ranks[0]}..{ranks[-1]}"
        return ", ".join(map(str, ranks))

    def model_states(self, tp: int) -> dict[str, Any]:
        """TP rank ``tp``'s model states."""
        if tp not in self._model_states:
            self._model_states[tp] = _load(self.model_files[tp])
        return self._model_states[tp]

    def grid_model_states(self, tp: int, dp: int) -> dict[str, Any]:
        """ZeRO-3: the (TP, DP) rank's model states (DP rank 0's are :meth:`model_states`)."""
        if dp == 0:
            return self.model_states(tp)
        key = (tp, dp)
        if key not in self._grid_states:
            self._grid_states[key] = _load(self.model_grid[key])
        return self._grid_states[key]

    def optimizer_file_state(self, tp: int, dp: int) -> dict[str, Any]:
        """The ``optimizer_state_dict`` payload of the (tp, dp) optimizer file."""
        key = (tp, dp)
        if key not in self._optim_states:
            path = self.optim_files[key]
            data = _load(path)
            state = data.get(keys.OPTIMIZER_STATE_DICT) if isinstance(data, dict) else None
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: no optimizer_state_dict")
            self._optim_states[key] = state
        return self._optim_states[key]


def indexed_state(base: Any, path: Path) -> dict[str, Any]:
    """A torch optimizer state dict as the layouts read it: ``state`` a dict from parameter index to that
    parameter's dict of tensors. torch and DeepSpeed write ``state`` as a dict; a list (one entry per index)
    is read as the same thing. Anything else is refused naming ``path``."""
    if not isinstance(base, dict):
        raise CheckpointError(f"{path}: the wrapped optimizer's state dict is a {type(base).__name__}, not a dict")
    state = base.get(keys.STATE)
    if state is None:
        return base
    if isinstance(state, list | tuple):
        state = dict(enumerate(state))
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the optimizer's 'state' is a {type(state).__name__}, not a dict or a list")
    for index, entry in state.items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: optimizer state entry {index!r} is a {type(entry).__name__}, not a dict "
                                  "of tensors")
    return {**base, keys.STATE: state} if state is not base[keys.STATE] else base


@dataclass(frozen=True)
class SavedDegrees:
    """The degrees a DeepSpeed tag was saved at, as its first model-states file records them: what a live engine
    compares with its own to tell whether DeepSpeed's loader can read the tag as it is."""

    model_parallel: int  # TP x PP: DeepSpeed's mp_world_size
    pipeline: int
    data_parallel: int
    expert_parallel: int | None  # None without AutoEP; -1 where the layers disagree
    zero3_files: bool  # ZeRO-3's per-rank model states, which DeepSpeed's loader reads only into ZeRO-3

    @classmethod
    def read(cls, tag_dir: Path) -> SavedDegrees | None:
        """None where the tag has no model-states file."""
        from deepspeed_ext.checkpoint import serialization
        from deepspeed_ext.checkpoint.deepspeed.experts import AUTOEP_LAYERS
        model_files = sorted(tag_dir.glob(keys.MODEL_STATES_GLOB))
        if not model_files:
            return None
        saved = serialization.load(model_files[0])
        dims = saved.get(keys.CHECKPOINT_PARALLEL_DIMS) or {}
        layers = saved.get(AUTOEP_LAYERS) or []
        ep_sizes = {int(layer.get("ep_size", 1)) for layer in layers if isinstance(layer, dict)}
        return cls(model_parallel=int(saved.get(keys.MP_WORLD_SIZE) or 1),
                   pipeline=int(dims.get(keys.CHECKPOINT_PP_DEGREE, 1) or 1),
                   data_parallel=int(saved.get(keys.DP_WORLD_SIZE) or 1),
                   expert_parallel=ep_sizes.pop() if len(ep_sizes) == 1 else (None if not ep_sizes else -1),
                   zero3_files=any(keys.ZERO3_MODEL_STATES_RE.match(p.name) for p in model_files))
