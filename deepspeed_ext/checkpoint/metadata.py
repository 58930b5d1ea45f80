"""deepspeed-ext's UC info file (``deepspeed_ext.json``): TP layouts plus the model config.

It is written beside DeepSpeed's files in every checkpoint tag directory saved through
``deepspeed_ext.initialize`` and copied into universal checkpoints. Plain JSON, so plain DeepSpeed
ignores it and any tool can read it without unpickling anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.checkpoint.commit import COMMIT_FILE, UC_INFO_FILE
from deepspeed_ext.checkpoint.commit import UC_INFO_KEY as COMMIT_KEY
from deepspeed_ext.checkpoint.fingerprint import FINGERPRINTS_KEY, Fingerprints
from deepspeed_ext.errors import CheckpointError, LayoutError
from deepspeed_ext.module_inject.layout import TPLayout, layouts_from_json, layouts_to_json

METADATA_FILE = UC_INFO_FILE
METADATA_FORMAT = "deepspeed_ext.uc_info"
METADATA_VERSION = 1


@dataclass
class UCInfo:
    """What deepspeed-ext records about a checkpoint."""

    tp_size: int
    layouts: dict[str, TPLayout]
    model_config: dict[str, Any] | None = None
    model_class: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    kind: str = "deepspeed"  # "deepspeed" (a regular tag directory) or "universal"
    #: Without ZeRO, DeepSpeed's optimizer state does not name its parameters: their names per param
    #: group, in the optimizer's order, recorded at save time.
    optimizer_param_names: list[list[str]] | None = None
    #: The resume fingerprints of the state saved with it (:mod:`deepspeed_ext.checkpoint.fingerprint`).
    fingerprints: Fingerprints | None = None
    #: The tag is committed by a marker written last (:mod:`deepspeed_ext.checkpoint.commit`): without one, the
    #: save did not finish.
    commit_marker: bool = False
    #: The frozen parameters (weights only: no optimizer steps them): a tag's, as the engine had them (every
    #: pipeline stage's); a universal checkpoint's, those it holds. None: not recorded (an older deepspeed-ext).
    frozen: list[str] | None = None
    #: What shapes a step as the engine ran it (:func:`~deepspeed_ext.checkpoint.engine_private.step_settings`:
    #: gradient clipping, accumulation, micro batch, precision), DeepSpeed's defaults applied.
    engine_settings: dict[str, Any] | None = None
    #: The peft adapters the model had (``configs``: name -> its peft config as adapter_config.json holds it;
    #: ``active``: the adapters it ran with). None: none (or not recorded).
    adapters: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": METADATA_FORMAT,
            "version": METADATA_VERSION,
            "kind": self.kind,
            "tp_size": self.tp_size,
            "versions": self.versions,
            "model_class": self.model_class,
            "model_config": self.model_config,
            "params": layouts_to_json(self.layouts),
            **({"optimizer_param_names": self.optimizer_param_names} if self.optimizer_param_names else {}),
            **({FINGERPRINTS_KEY: self.fingerprints.to_json()} if self.fingerprints is not None else {}),
            **({COMMIT_KEY: COMMIT_FILE} if self.commit_marker else {}),
            **({"frozen_params": self.frozen} if self.frozen is not None else {}),
            **({"engine_settings": self.engine_settings} if self.engine_settings else {}),
            **({"adapters": self.adapters} if self.adapters else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "") -> UCInfo:
        if data.get("format") != METADATA_FORMAT:
            raise CheckpointError(f"{source}: not a deepspeed-ext UC info file")
        if int(data.get("version", 0)) > METADATA_VERSION:
            raise CheckpointError(f"{source}: UC info version {data['version']} is newer than this deepspeed-ext "
                                  f"understands ({METADATA_VERSION}); upgrade deepspeed-ext")
        return cls(tp_size=int(data["tp_size"]),
                   layouts=layouts_from_json(data["params"]),
                   model_config=data.get("model_config"),
                   model_class=data.get("model_class"),
                   versions=dict(data.get("versions") or {}),
                   kind=data.get("kind", "deepspeed"),
                   optimizer_param_names=data.get("optimizer_param_names"),
                   fingerprints=(Fingerprints.from_json(data[FINGERPRINTS_KEY], source)
                                 if data.get(FINGERPRINTS_KEY) is not None else None),
                   commit_marker=bool(data.get(COMMIT_KEY)),
                   frozen=([str(name) for name in data["frozen_params"]]
                           if data.get("frozen_params") is not None else None),
                   engine_settings=dict(data["engine_settings"]) if data.get("engine_settings") else None,
                   adapters=dict(data["adapters"]) if data.get("adapters") else None)


def write_uc_info(directory: str | os.PathLike[str], info: UCInfo) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / METADATA_FILE
    durable.replace_file(path, json.dumps(info.to_json(), indent=1, sort_keys=True))
    return path


def read_uc_info(directory: str | os.PathLike[str]) -> UCInfo | None:
    """The UC info stored in ``directory``, or None when there is none."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot parse JSON: {exc}") from exc
    try:
        return UCInfo.from_json(data, source=str(path))
    except (KeyError, TypeError, ValueError, AttributeError, LayoutError) as exc:
        raise CheckpointError(f"{path}: malformed UC info: {exc}") from exc
