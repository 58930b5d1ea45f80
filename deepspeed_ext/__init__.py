"""deepspeed-ext: universal checkpoints for DeepSpeed AutoTP + ZeRO training.

Add ``"deepspeed_ext": {"universal_checkpoint": {"enabled": true}}`` to the DeepSpeed config, and either
call :func:`deepspeed_ext.enable` once (every ``deepspeed.initialize`` then honours the section: the Hugging
Face Trainer's, Accelerate's, your own) or replace ``deepspeed.initialize`` with
:func:`deepspeed_ext.initialize` (docs/trainers.md).
Checkpoints in any supported format: :func:`open_checkpoint`, :func:`convert`, :func:`verify`
(docs/python-api.md).
"""

from __future__ import annotations

from collections.abc import Iterator
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


def hf_weights(engine: Any, *, names: str = "hf", dtype: str = "source", quantize: str | None = None,
               fp8_block: tuple[int, int] = (128, 128), adapters: str = "merge",
               bucket_bytes: int = 32 << 20) -> Iterator[tuple[str, Any]]:
    """The engine's full weights, ``(name, tensor)`` one at a time in a stable order, on every rank (collective:
    every rank iterates to the end). ``names``: ``hf`` (the model's, as ``model.state_dict()`` has them), ``files``
    (the HF files', as ``to-hf`` writes them and vLLM's ``load_weights`` reads them) or ``module`` (the engine's
    own). ``dtype``: ``source`` (the module's), ``bfloat16``, ``float16``, ``float32``. ``quantize="fp8"``: linear
    weights in block FP8 with their ``weight_scale_inv`` (``names="files"``). ``adapters``: a peft model's LoRA
    adapters ``merge``-d into the weights, or ``only`` the adapters (as ``adapter_model.safetensors`` names them).
    Memory: a bucket of ``bucket_bytes`` (a larger tensor alone), never the model (docs/weight-streaming.md)."""
    from deepspeed_ext.weights.engine_side import hf_weights as _hf_weights
    from deepspeed_ext.weights.naming import WeightOptions
    options = WeightOptions(names=names, dtype=dtype, quantize=quantize, fp8_block=fp8_block, adapters=adapters)
    return _hf_weights(engine, options, bucket_bytes)


def weight_group(host: str, port: int, *, senders: int, receivers: int = 1, rank: int | None = None,
                 receiver: int | None = None, backend: str = "gloo", timeout: float = 300.0) -> Any:
    """The groups a weight update travels over, between ``senders`` training ranks (each joins with its ``rank``)
    and ``receivers`` inference processes (each with ``receiver=``); training rank 0 hosts the store at
    ``host:port``. ``backend``: ``gloo`` or ``nccl``. See :func:`send_weights`."""
    from deepspeed_ext.weights.groups import WeightGroup
    return WeightGroup(host, port, senders=senders, receivers=receivers, rank=rank, receiver=receiver,
                       backend=backend, timeout=timeout)


def send_weights(engine: Any, group: Any, *, version: int | None = None, adapters_only: bool = False,
                 bucket_bytes: int = 32 << 20) -> int:
    """Broadcast ``engine``'s weights to the receivers of ``group`` (every training rank calls it; each sends
    what it holds). Returns the update's version (``version``, else one more than the last)."""
    from deepspeed_ext.weights.transfer import send_weights as _send
    return _send(engine, group, version=version, adapters_only=adapters_only, bucket_bytes=bucket_bytes)


def receive_weights(group: Any, sink: Any, **options: Any) -> int:
    """Receive the next update of ``group`` into ``sink``: a torch module (in place), a model with vLLM's
    ``load_weights``, or a callable ``(name, tensor)``. Returns its version; an update missed or cut short is
    refused in one line. Options: ``names``, ``dtype``, ``quantize``, ``atomic``, ``expect_version``."""
    from deepspeed_ext.weights.transfer import receive_weights as _receive
    return _receive(group, sink, **options)


def __getattr__(name: str) -> Any:
    # The checkpoint API imports only when used: `import deepspeed_ext` stays instant.
    if name in ("open_checkpoint", "convert", "verify"):
        from deepspeed_ext import api
        return getattr(api, name)
    raise AttributeError(f"module 'deepspeed_ext' has no attribute {name!r}")


__all__ = ["initialize", "enable", "disable", "tensor_parallel_preset", "expert_parallel_preset", "hf_weights",
           "weight_group", "send_weights", "receive_weights",
            "open_checkpoint", "convert", "verify", "__version__"]
