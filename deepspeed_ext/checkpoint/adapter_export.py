"""What a conversion writes of an adapter checkpoint (a peft model's: LoRA adapters on a frozen base): ``to-hf``
the PEFT adapter, or with ``merge`` the merged model; ``to-maxtext`` the merged weights; ``to-universal``
everything, as it is. The choice is made here, once, for the API and the CLI; the writers see an ordinary source
(:class:`~deepspeed_ext.checkpoint.adapter_merge.MergedSource`) or write the adapter
(:func:`~deepspeed_ext.checkpoint.hf.peft_adapter.write_adapter`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from deepspeed_ext.checkpoint.adapters import AdapterModel, LoraSettings, find_adapters, read_adapter_config
from deepspeed_ext.checkpoint.source import CheckpointSource
from deepspeed_ext.errors import CheckpointError

#: The options of :func:`prepare`, which ``convert`` takes beside the writer's own.
ADAPTER_OPTIONS = ("merge", "adapters", "base", "adapter_config")


def adapter_model(source: CheckpointSource, adapter_config: str | Path | None = None) -> AdapterModel | None:
    """The adapters of ``source`` (None: it has none), with their peft configs as recorded, or ``adapter_config``
    (an ``adapter_config.json``) for the one adapter it has."""
    recorded = source.info.adapters or {}
    model = find_adapters(source.info.layouts, recorded.get("configs") or {}, recorded.get("active") or (),
                          with_base=False)
    if model is not None and not _base_less(source):
        model.base_saved(str(source.info.given))  # all or none: one line where only some are there
    if model is None or adapter_config is None:
        return model
    if len(model.adapters) != 1:
        raise CheckpointError(f"{source.info.given}: --adapter-config gives one adapter's config; this checkpoint has "
                              f"{len(model.adapters)} ({', '.join(sorted(model.adapters))})")
    name = next(iter(model.adapters))
    model.adapters[name] = LoraSettings(name, read_adapter_config(Path(adapter_config)))
    return model


def _base_less(source: CheckpointSource) -> bool:
    """A PEFT adapter directory read without its base model."""
    from deepspeed_ext.checkpoint.hf.peft_adapter import PeftAdapterSource
    return isinstance(source, PeftAdapterSource) and source.base is None


def prepare(source: CheckpointSource, target: str, *, merge: bool = False, adapters: Iterable[str] = (),
            base: str | Path | CheckpointSource | None = None, adapter_config: str | Path | None = None,
            open_base: Callable[[str | Path], CheckpointSource] | None = None
            ) -> tuple[CheckpointSource, AdapterModel | None, list[str]]:
    """What to write of ``source`` in format ``target``: the source to hand the writer, and, where the PEFT adapter
    is what is written, its adapter structure and the adapters chosen (else None and [])."""
    adapters = list(adapters)
    label = str(source.info.given)
    if _base_less(source) and (target != "huggingface" or merge):
        from deepspeed_ext.checkpoint.hf.peft_adapter import PeftAdapterSource, missing_base
        assert isinstance(source, PeftAdapterSource)
        raise missing_base(source)
    asked = merge or adapters or base is not None or adapter_config is not None
    model = adapter_model(source, adapter_config)
    if model is None:
        if asked:
            raise CheckpointError(f"{label}: not an adapter checkpoint (no peft lora_A / lora_B parameters); "
                                  "--merge, --adapter, --base and --adapter-config apply to peft LoRA checkpoints")
        return source, None, []
    if target == "universal":
        if asked:
            raise CheckpointError(f"{label}: to-universal keeps the adapters and the base as they are; --merge, "
                                  "--adapter and --base apply to to-hf and to-maxtext")
        return source, None, []
    chosen = model.choose(adapters, label)
    if target == "huggingface" and not merge:
        if base is not None:
            raise CheckpointError(f"{label}: --base is for --merge (a PEFT adapter holds no base weights; peft loads "
                                  "it onto the base model)")
        return source, model, chosen
    base_source = None
    if base is not None:
        base_source = base if isinstance(base, CheckpointSource) else _open_base(base, open_base)
        if base_source.info.format != "huggingface" or base_source.info.adapters:
            raise CheckpointError(f"{base_source.info.given}: --base must be the base model as an HF directory "
                                  "(config.json + safetensors)")
    from deepspeed_ext.checkpoint.adapter_merge import AdaptersOnBase, MergedSource
    if not model.base_saved(label):  # saved without its frozen parameters: the base model gives them
        if base_source is None:
            raise CheckpointError(f"{label}: the checkpoint holds the adapters alone (its frozen base weights were "
                                  "not saved: exclude_frozen_parameters, as the Trainer saves a peft model); pass "
                                  "--base BASE_MODEL_DIR (the HF model the adapters were trained on)")
        source = AdaptersOnBase(source, model, base_source)
        model = adapter_model(source, adapter_config)
        assert model is not None
        base_source = None  # the base's weights are the only copy: nothing to check them against
    return MergedSource(source, model, chosen, base_source), None, []


def _open_base(path: str | Path, open_base: Callable[[str | Path], CheckpointSource] | None) -> CheckpointSource:
    if open_base is None:
        from deepspeed_ext.checkpoint.formats import open_checkpoint
        return open_checkpoint(path)
    return open_base(path)


def refuse_optimizer_export(source: CheckpointSource) -> None:
    """One line for a full-state export (MaxText's optimizer continuing the run) of an adapter checkpoint."""
    raise CheckpointError(f"{source.info.given}: an adapter checkpoint: its optimizer state is the adapters' alone, "
                          "and MaxText's optimizer would train the whole merged model; write the merged weights "
                          "(without --with-optimizer)")
