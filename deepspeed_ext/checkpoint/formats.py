"""Which checkpoint format a path holds, and opening it as a source: the one place commands find their input.

* **DeepSpeed** — a save directory (``latest`` names the tag) or a tag directory (``*model_states.pt``).
* **universal** — a universal directory (``zero/``) or a save directory whose ``latest_universal`` names one.
* **Hugging Face** — a model directory with ``*.safetensors`` (and ``config.json``, or ``--config``).
* **MaxText** — an Orbax checkpoint: the item directory (``_METADATA``), its step directory, or the root of the
  checkpoint manager (``<root>/<step>/items``, the highest step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepspeed_ext.errors import CheckpointError, MissingConfigError

DEEPSPEED, UNIVERSAL, HUGGINGFACE, MAXTEXT = "deepspeed", "universal", "huggingface", "maxtext"

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
ORBAX_METADATA = "_METADATA"
ORBAX_ITEM = "items"


def maxtext_items(path: Path) -> Path | None:
    """The Orbax item directory that ``path`` (item, step or root directory) designates, else None."""
    if (path / ORBAX_METADATA).is_file():
        return path
    if (path / ORBAX_ITEM / ORBAX_METADATA).is_file():
        return path / ORBAX_ITEM
    steps = [p for p in path.iterdir() if p.name.isdigit() and (p / ORBAX_ITEM / ORBAX_METADATA).is_file()]
    return max(steps, key=lambda p: int(p.name)) / ORBAX_ITEM if steps else None


def detect_all(path: str | Path, tag: str | None = None) -> list[str]:
    """Every format at ``path``, the most specific first; one line naming the path and what is wrong with it
    when there is none. A directory can hold two: a Hugging Face Trainer checkpoint (``checkpoint-500/``) has
    the DeepSpeed save (``latest`` + ``global_step500/``) beside the model's safetensors."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        hint = ("the model directory that holds it and config.json" if path.suffix == ".safetensors" else
                "the save directory or the tag directory that holds it" if path.suffix == ".pt" else
                "a checkpoint directory")
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory; give {hint}")
    if tag is not None:
        return [UNIVERSAL if (path / tag / ZERO_DIR).is_dir() else DEEPSPEED]
    found = []
    if (path / ZERO_DIR).is_dir():  # a universal directory (it holds copies of the model-states files too)
        found.append(UNIVERSAL)
    elif any(path.glob("*mp_rank_*_model_states.pt")) or (path / LATEST).is_file():
        found.append(DEEPSPEED)
    elif (path / LATEST_UNIVERSAL).is_file():
        found.append(UNIVERSAL)
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        found.append(HUGGINGFACE)
    if maxtext_items(path) is not None:
        found.append(MAXTEXT)
    if found:
        return found
    if (path / "config.json").is_file():
        raise CheckpointError(f"{path}: has config.json but no *.safetensors weights (a Hugging Face checkpoint "
                              "needs them; .bin weights are not read, as they are pickles)")
    raise CheckpointError(f"{path}: not a checkpoint: neither a tag directory (DeepSpeed *model_states.pt, or "
                          "universal zero/) nor a save directory ('latest' or 'latest_universal'), nor Hugging Face "
                          f"*.safetensors, nor Orbax {ORBAX_METADATA}")


def detect(path: str | Path, tag: str | None = None) -> str:
    """The format at ``path`` (the most specific, where there are several)."""
    return detect_all(path, tag)[0]


def read_config(config_path: str | Path) -> dict[str, Any]:
    """A model config (HF ``config.json``) given with ``--config``."""
    try:
        config = json.loads(Path(config_path).read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{config_path}: no such file (--config)") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: cannot read a JSON model config: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object (an HF config.json)")
    return config


def open_checkpoint(path: str | Path,
                    *,
                    tag: str | None = None,
                    config: str | Path | None = None,
                    family: str | None = None,
                    dtype: str = "source",
                    accept: dict[str, str] | None = None) -> Any:
    """The source at ``path`` in whatever format it is.

    ``config``: an HF config.json for the formats that need one and may lack it (HF weights without
    config.json, MaxText checkpoints not written by deepspeed-ext). ``family``: MaxText's model family.
    ``dtype``: the dtype HF weights are read in. ``accept``: the formats the caller reads, each mapped to
    nothing, and the others to the line it says when one of them is found instead.
    """
    found = detect_all(path, tag)
    readable = [kind for kind in found if accept is None or not accept.get(kind)]
    if not readable:
        raise CheckpointError(f"{path}: {accept[found[0]]}")
    kind = readable[0]
    if kind == HUGGINGFACE:
        from deepspeed_ext.checkpoint.hf import HFCheckpoint
        return HFCheckpoint(path, dtype=dtype, model_config=read_config(config) if config else None)
    if kind == MAXTEXT:
        return open_maxtext(maxtext_items(Path(path)), config, family)
    if kind == UNIVERSAL:
        from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
        return UniversalCheckpoint(path, tag)
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    return DeepSpeedCheckpoint(path, tag)


def open_maxtext(items: Path, config_path: str | Path | None, family_name: str | None) -> Any:
    """A MaxText checkpoint with its HF config and family: given, else what to-maxtext recorded."""
    from deepspeed_ext.checkpoint.families import get_family, infer_family
    from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint, stored_model_info
    stored = stored_model_info(items)
    if config_path:
        config = read_config(config_path)
    elif stored.get("model_config"):
        config = stored["model_config"]
    else:
        raise MissingConfigError(f"{items}: no model config recorded with this MaxText checkpoint (it was not written "
                              "by deepspeed-ext); pass --config config.json (the model's HF config)")
    family_name = family_name or stored.get("family")
    family = get_family(family_name) if family_name else infer_family(config)
    return MaxTextCheckpoint(items, family, config)
