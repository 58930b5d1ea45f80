"""The Python API: open a checkpoint in any format, convert it, verify it (what the CLI calls).

    import deepspeed_ext
    source = deepspeed_ext.open_checkpoint("checkpoints")          # DeepSpeed, universal, HF or MaxText
    print(source.info.format, source.info.tp_degree, len(source.info.layouts))
    deepspeed_ext.convert(source, "universal_out", to="universal")
    deepspeed_ext.convert("checkpoints", "hf_out", to="hf", dtype="bfloat16")
    report = deepspeed_ext.verify("hf_out")
    assert report.ok, report.lines()

Errors are :class:`deepspeed_ext.errors.DeepSpeedExtError` subclasses whose message is the one line the CLI
prints. See docs/python-api.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint.adapter_export import ADAPTER_OPTIONS
from deepspeed_ext.checkpoint.adapter_export import prepare as prepare_adapters
from deepspeed_ext.checkpoint.formats import FORMATS, TARGETS
from deepspeed_ext.checkpoint.formats import open_checkpoint as _open_checkpoint
from deepspeed_ext.checkpoint.source import CheckpointSource
from deepspeed_ext.checkpoint.verify import VerifyReport
from deepspeed_ext.checkpoint.verify import verify as _verify


def open_checkpoint(path: str | Path,
                    *,
                    tag: str | None = None,
                    config: str | Path | Mapping[str, Any] | None = None,
                    family: str | None = None,
                    dtype: str = "source",
                    mtp: str | None = None,
                    format: str | None = None,
                    base: str | Path | None = None) -> CheckpointSource:
    """Open the checkpoint at ``path``, whatever its format; nothing but metadata is read yet.

    ``tag``: the DeepSpeed tag (default: ``latest``). ``config``: an HF config (``config.json`` path or dict) to
    use instead of the one recorded with the checkpoint (needed for HF weights without ``config.json`` and for
    MaxText checkpoints not written by deepspeed-ext). ``family``: a MaxText checkpoint's model family
    (default: recorded, else inferred). ``dtype``: HF weights are read in this dtype (``source``: the files';
    quantized weights: what transformers dequantizes them to). ``mtp``: an HF release's layers past
    ``num_hidden_layers`` (DeepSeek-V3's multi-token prediction): None refuses them, ``"drop"`` leaves them out,
    ``"keep"`` writes them back into an HF output.
    ``format``: which to read where the directory holds two (``deepspeed`` or ``huggingface`` in a Hugging Face
    Trainer checkpoint). ``base``: the base model (an HF directory) of a PEFT adapter directory (default: the local
    directory its ``base_model_name_or_path`` names): the adapter is read as the ``PeftModel`` it makes. The result has ``info`` (a :class:`~deepspeed_ext.checkpoint.source.SourceInfo`),
    ``tensors()`` (full tensors, streamed one at a time) and ``summary()``.
    """
    return _open_checkpoint(path, tag=tag, config=config, family=family, dtype=dtype, mtp=mtp, format=format, base=base)


def convert(source: CheckpointSource | str | Path,
            output: str | Path | None,
            *,
            to: str,
            tag: str | None = None,
            config: str | Path | Mapping[str, Any] | None = None,
            family: str | None = None,
            **options: Any) -> Path:
    """Write ``source`` (an opened checkpoint, or a path to open) in format ``to`` at ``output``.

    ``to``: ``universal`` (``output``: a save directory ``OUT/<tag>_universal`` + ``OUT/latest_universal``;
    None: beside the DeepSpeed tag), ``hf`` or ``maxtext``. ``tag``, ``config``, ``family``: as for
    :func:`open_checkpoint` when ``source`` is a path (``family`` also picks the MaxText family written).
    ``options``: the writer's options, e.g. ``overwrite``, ``progress``, ``check_finite`` for every format,
    ``dtype`` and ``max_shard_size`` for ``hf``, ``scan_layers``, ``dtype``, ``mesh``, ``with_optimizer``,
    ``compression``, ``ocdbt`` for ``maxtext``, ``distributed`` for ``universal`` (see the ``*Options``
    classes). An adapter checkpoint (peft LoRA, docs/adapters.md) is written as a PEFT adapter directory by ``hf``,
    merged by ``hf`` with ``merge=True`` and by ``maxtext``; ``adapters`` picks adapters (default: the active ones),
    ``base`` an HF base model whose weights to merge into (checked against the checkpoint's), ``adapter_config`` an
    ``adapter_config.json`` for a checkpoint that records none. Returns the written checkpoint: the universal directory, the HF directory, or MaxText's
    ``OUT/0/items``.

    The output is built aside and published only when complete; it may not be, contain or lie inside the
    source.
    """
    if to not in TARGETS:
        raise ValueError(f"to={to!r}: choose one of {', '.join(sorted(TARGETS))}")
    target = FORMATS[TARGETS[to]]
    if not isinstance(source, CheckpointSource):
        path = source
        if options.get("distributed"):  # every rank opens it; one that cannot is heard by all
            from deepspeed_ext.checkpoint.collective import on_every_rank
            source = on_every_rank(lambda: _open_checkpoint(path, tag=tag, config=config, family=family))
        else:
            source = _open_checkpoint(path, tag=tag, config=config, family=family)
    if family is not None and target.name == "maxtext":
        options["family"] = family
    if output is None and target.name != "universal":
        raise ValueError(f"to={to!r} needs an output directory")
    adapter_options = {key: options.pop(key) for key in ADAPTER_OPTIONS if key in options}
    source, adapter_model, adapters = prepare_adapters(source, target.name, **adapter_options)
    if adapter_model is not None:
        assert output is not None  # checked above: only the universal writer has a default
        from deepspeed_ext.checkpoint.hf.peft_adapter import write_adapter
        return write_adapter(source, adapter_model, adapters, output, target.write_options(**options))
    return target.write(source, output, target.write_options(**options))


def verify(path: str | Path, *, config: str | Path | None = None, family: str | None = None,
           strict: bool = False) -> VerifyReport:
    """Check the checkpoint at ``path``: an output of deepspeed-ext against its manifest, a DeepSpeed checkpoint
    file by file, and every tensor's shape, dtype and finiteness. ``report.ok``; ``report.lines()`` says what
    was found (each problem, then a summary). Files beside a manifest that it does not list (a README added
    later) are reported in ``report.unlisted``; ``strict`` makes them problems."""
    return _verify(path, config=config, family=family, strict=strict)
