"""The ``"deepspeed_ext"`` section of a DeepSpeed config.

Plain DeepSpeed ignores unknown top-level sections, so the same config file works with and without
deepspeed-ext::

    "deepspeed_ext": {
      "universal_checkpoint": {
        "enabled": true,          # tag AutoTP parameters and store UC info at every save_checkpoint
        "restore": "deepspeed_ext"  # who loads universal checkpoints when checkpoint.load_universal is
                                    # true: "deepspeed_ext" (each rank reads only its slice, any TP/DP)
                                    # or "deepspeed" (upstream's loader)
        "fingerprints": "error"   # record resume fingerprints at save and check them after every load:
                                  # "error" (a mismatch raises), "warn" (it is logged), "off"
      },
      "async_save": false         # save_checkpoint returns once the state is snapshotted; the files, the commit
                                  # and 'latest' are written in the background (docs/reliability.md). Or an
                                  # object: {"snapshot": "fork" | "copy"}: how the state is snapshotted (true:
                                  # host copies; a fork only on a CPU engine)
    }
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

SECTION = "deepspeed_ext"
RESTORE_CHOICES = ("deepspeed_ext", "deepspeed")
FINGERPRINT_CHOICES = ("error", "warn", "off")
#: How a save in the background takes its snapshot: a fork of the rank (CPU engines), or host copies written by a
#: thread (any engine). None: the default for the engine's device (deepspeed_ext.runtime.background_save).
SNAPSHOT_CHOICES = ("fork", "copy")


@dataclass(frozen=True)
class UniversalCheckpointConfig:
    enabled: bool = False
    restore: str = "deepspeed_ext"
    fingerprints: str = "error"


@dataclass(frozen=True)
class ExtConfig:
    universal_checkpoint: UniversalCheckpointConfig = field(default_factory=UniversalCheckpointConfig)
    async_save: bool = False
    async_snapshot: str | None = None

    @property
    def hooks_engine(self) -> bool:
        """Whether the engine gets deepspeed-ext's tagging and checkpoint hooks (an asynchronous save is one of
        deepspeed-ext's saves: tagged, fingerprinted, committed)."""
        return self.universal_checkpoint.enabled or self.async_save

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | None) -> ExtConfig:
        section = (ds_config or {}).get(SECTION) or {}
        if not isinstance(section, Mapping):
            raise ValueError(f"DeepSpeed config: '{SECTION}' must be an object")
        _reject_unknown(section, {"universal_checkpoint", "async_save"}, SECTION)
        async_save, snapshot = section.get("async_save", False), None
        if isinstance(async_save, Mapping):
            _reject_unknown(async_save, {"enabled", "snapshot"}, f"{SECTION}.async_save")
            snapshot = async_save.get("snapshot")
            if snapshot is not None and snapshot not in SNAPSHOT_CHOICES:
                raise ValueError(f"DeepSpeed config: '{SECTION}.async_save.snapshot' must be one of "
                                 f"{SNAPSHOT_CHOICES}, got {snapshot!r}")
            async_save = async_save.get("enabled", True)
        if not isinstance(async_save, bool):
            raise ValueError(f"DeepSpeed config: '{SECTION}.async_save' must be true, false or an object "
                             f"({{\"snapshot\": \"fork\" | \"copy\"}})")
        uc = section.get("universal_checkpoint") or {}
        if not isinstance(uc, Mapping):
            raise ValueError(f"DeepSpeed config: '{SECTION}.universal_checkpoint' must be an object")
        _reject_unknown(uc, {"enabled", "restore", "fingerprints"}, f"{SECTION}.universal_checkpoint")
        enabled = uc.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ValueError(f"DeepSpeed config: '{SECTION}.universal_checkpoint.enabled' must be true or false")
        restore = uc.get("restore", "deepspeed_ext")
        if restore not in RESTORE_CHOICES:
            raise ValueError(f"DeepSpeed config: '{SECTION}.universal_checkpoint.restore' must be one of "
                             f"{RESTORE_CHOICES}, got {restore!r}")
        fingerprints = uc.get("fingerprints", "error")
        if fingerprints not in FINGERPRINT_CHOICES:
            raise ValueError(f"DeepSpeed config: '{SECTION}.universal_checkpoint.fingerprints' must be one of "
                             f"{FINGERPRINT_CHOICES}, got {fingerprints!r}")
        return cls(universal_checkpoint=UniversalCheckpointConfig(enabled=enabled, restore=restore,
                                                                  fingerprints=fingerprints),
                   async_save=async_save, async_snapshot=snapshot)


def _reject_unknown(section: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"DeepSpeed config: unknown key(s) {unknown} in '{where}' (allowed: {sorted(allowed)})")


def load_ds_config(config: Any) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a path to a JSON (or HJSON) file, as a dict."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    text = path.read_text()
    try:
        loaded: dict[str, Any] = json.loads(text)
        return loaded
    except ValueError:
        import hjson  # type: ignore[import-untyped]  # DeepSpeed depends on it and accepts HJSON configs
        return dict(hjson.loads(text))
