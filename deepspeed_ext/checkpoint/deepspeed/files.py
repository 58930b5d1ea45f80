"""Which files a DeepSpeed tag directory holds, and the memory-mapped, cached reading of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError


def resolve_tag_dir(path: str | Path, tag: str | None = None, latest_file: str = keys.LATEST) -> Path:
    """The tag directory from a save dir (+ optional tag, else its ``latest`` file) or a tag dir itself."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"{tag_dir}: no such tag directory")
        return tag_dir
    if any(keys.MODEL_STATES_RE.match(p.name) or keys.ZERO3_MODEL_STATES_RE.match(p.name) for p in path.iterdir()):
        return path
    latest = path / latest_file
    if latest.is_file():
        tag = latest.read_text().strip()
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"{latest}: names tag {tag!r}, but {tag_dir} does not exist")
        return tag_dir
    raise CheckpointError(f"{path}: neither a tag directory (no mp_rank_*_model_states.pt) nor a save directory "
                          f"with a '{latest_file}' file; pass --tag")


@dataclass
class TagFiles:
    """The files of one tag directory, each loaded (memory-mapped) at most once."""

    tag_dir: Path
    #: TP rank -> its model-states file (under ZeRO-3 the DP-0 one, which carries the same metadata).
    model_files: dict[int, Path]
    #: Every model-states file (under ZeRO-3 one per rank).
    all_model_files: list[Path]
    #: (TP rank, DP rank) -> optimizer file; empty without ZeRO, where the optimizer is in the model states.
    optim_files: dict[tuple[int, int], Path]
    #: ZeRO-3's per-rank model-states files are present (the weights themselves are partitioned).
    partitioned_weights: bool
    _model_states: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _optim_states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def scan(cls, tag_dir: Path) -> TagFiles:
        names = sorted(p.name for p in tag_dir.iterdir())
        zero3 = {int(m.group(2)): tag_dir / name for name in names
                 if (m := keys.ZERO3_MODEL_STATES_RE.match(name)) and int(m.group(1)) == 0}
        model_files = zero3 or {int(m.group(1)): tag_dir / name
                                for name in names if (m := keys.MODEL_STATES_RE.match(name))}
        if not model_files:
            raise CheckpointError(f"{tag_dir}: no mp_rank_*_model_states.pt files")
        optim_files = {(int(m.group(3)), int(m.group(2))): tag_dir / name
                       for name in names if (m := keys.OPTIM_STATES_RE.match(name))}
        return cls(tag_dir=tag_dir,
                   model_files=model_files,
                   all_model_files=[tag_dir / name for name in names
                                    if keys.MODEL_STATES_RE.match(name) or keys.ZERO3_MODEL_STATES_RE.match(name)],
                   optim_files=optim_files,
                   partitioned_weights=bool(zero3))

    def model_states(self, tp: int) -> dict[str, Any]:
        """TP rank ``tp``'s model states."""
        if tp not in self._model_states:
            self._model_states[tp] = serialization.load(self.model_files[tp])
        return self._model_states[tp]

    def optimizer_file_state(self, tp: int, dp: int) -> dict[str, Any]:
        """The ``optimizer_state_dict`` payload of the (tp, dp) optimizer file."""
        key = (tp, dp)
        if key not in self._optim_states:
            path = self.optim_files[key]
            data = serialization.load(path)
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
