"""deepspeed-ext: universal checkpoints for DeepSpeed AutoTP + ZeRO training.

Add ``"deepspeed_ext": {"universal_checkpoint": {"enabled": true}}`` to the DeepSpeed config, and either
call :func:`deepspeed_ext.enable` once (every ``deepspeed.initialize`` then honours the section: the Hugging
Face Trainer's, Accelerate's, your own) or replace ``deepspeed.initialize`` with
:func:`deepspeed_ext.initialize` (docs/trainers.md).
Checkpoints in any supported format: :func:`open_checkpoint`, :func:`convert`, :func:`verify`
(docs/python-api.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed_ext.version import __version__ as __version__

if TYPE_CHECKING:
    from deepspeed_ext.api import convert, open_checkpoint, verify


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """Drop-in replacement for ``deepspeed.initialize`` (same arguments, same return tuple)."""
    from deepspeed_ext.runtime import initialize as _initialize
    return _initialize(*args, **kwargs)


def enable() -> None:
    """Every ``deepspeed.initialize`` (the Trainer's, Accelerate's, your own) applies the config's
    ``deepspeed_ext`` section from now on; a config without it is left to DeepSpeed alone."""
    from deepspeed_ext.runtime import enable as _enable
    _enable()


def disable() -> None:
    """Undo :func:`enable`."""
    from deepspeed_ext.runtime import disable as _disable
    _disable()


def wait_for_saves(engine: Any) -> None:
    """Wait until the engine's save in the background (``"async_save": true``) is committed; raises its failure
    in one line. Collective: every rank calls it. Training steps, loads and the process's exit wait on their own
    (docs/reliability.md)."""
    from deepspeed_ext.runtime import wait_for_saves as _wait
    _wait(engine)


def tensor_parallel_preset(family: str) -> dict[str, Any]:
    """The keys a DeepSpeed config's ``"tensor_parallel"`` section needs for ``family`` under AutoTP ({} when
    AutoTP's defaults work), e.g. ``{"autotp_size": 2, **tensor_parallel_preset("mixtral")}``."""
    from deepspeed_ext.presets import tensor_parallel_preset as _preset
    return _preset(family)


def expert_parallel_preset(family: str) -> dict[str, Any]:
    """The keys a DeepSpeed config's ``"expert_parallel"`` section (AutoEP) needs for an MoE ``family``, e.g.
    ``{"enabled": True, "autoep_size": 2, **expert_parallel_preset("mixtral")}``."""
    from deepspeed_ext.presets import expert_parallel_preset as _preset
    return _preset(family)


def __getattr__(name: str) -> Any:
    # The checkpoint API imports only when used: `import deepspeed_ext` stays instant.
    if name in ("open_checkpoint", "convert", "verify"):
        from deepspeed_ext import api
        return getattr(api, name)
    raise AttributeError(f"module 'deepspeed_ext' has no attribute {name!r}")


__all__ = ["initialize", "enable", "disable", "tensor_parallel_preset", "expert_parallel_preset",
            "open_checkpoint", "convert", "verify", "__version__"]
