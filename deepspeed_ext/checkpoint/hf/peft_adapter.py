"""PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``, what peft's ``save_pretrained``
writes), both ways.

* :func:`write_adapter`: an adapter checkpoint's adapters as PEFT adapter directories, which
  ``PeftModel.from_pretrained(base, OUT)`` loads with no missing or unexpected keys: one adapter at ``OUT``; several
  as peft lays them out (``default`` at ``OUT``, each other one in ``OUT/<name>``).
* :class:`PeftAdapterSource`: a PEFT adapter on its base model (an HF directory) as the parameters a ``PeftModel``
  has (``base_model.model.…``; the base frozen, the adapter trainable), so ``from-hf`` starts a DeepSpeed run
  from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint import durable
from deepspeed_ext.checkpoint.adapters import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, PEFT_PREFIX, AdapterModel,
                                               find_adapters, live_name, peft_key, read_adapter_config)
from deepspeed_ext.checkpoint.hf.files import FileTensor, safetensors_header
from deepspeed_ext.checkpoint.hf.options import HFOptions
from deepspeed_ext.checkpoint.model_config import output_dtype, torch_dtype
from deepspeed_ext.checkpoint.source import CheckpointSource, SourceInfo
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS
from deepspeed_ext.checkpoint.tensor import LogicalTensor
from deepspeed_ext.checkpoint.writing import Write
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout


def is_peft_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG_FILE).is_file() and not (path / "config.json").is_file()


def adapter_directories(out: Path, adapters: list[str]) -> dict[str, Path]:
    """Where each adapter goes: one at ``out``; several as peft's ``save_pretrained`` puts them."""
    if len(adapters) == 1:
        return {adapters[0]: out}
    return {name: out if name == "default" else out / name for name in adapters}


def write_adapter(source: CheckpointSource, model: AdapterModel, adapters: list[str], out: str | Path,
                  options: HFOptions = HFOptions()) -> Path:
    """Write ``adapters`` of ``source`` as PEFT adapter directories at ``out``, through the write flow. The
    tensors are written in the dtype the model trained them in (``options.dtype``: another)."""
    label = str(source.info.given)
    for adapter in adapters:
        if not model.adapters[adapter].known:
            model.adapters[adapter].scaling("", 1)  # one line: how to give the config
    wanted = {name: adapter for adapter in adapters for name in model.parameters_of(adapter)}
    write = Write.of(source, out, options)
    places = adapter_directories(Path("."), adapters)

    def write_files(partial: Path) -> None:
        found: dict[str, dict[str, torch.Tensor]] = {adapter: {} for adapter in adapters}
        for tensor in write.verdicts.stream(t for t in source.tensors() if t.name in wanted):
            adapter = wanted[tensor.name]
            value = tensor.load_tensor(MASTER_WEIGHTS).to(output_dtype(options.dtype, tensor.dtype))
            found[adapter][peft_key(tensor.name, adapter, model.prefix)] = value.contiguous()
        for adapter, tensors in found.items():
            if not tensors:
                raise CheckpointError(f"{label}: adapter {adapter!r} has no parameters in this checkpoint")
            directory = partial / places[adapter]
            directory.mkdir(parents=True, exist_ok=True)
            _save_tensors(dict(sorted(tensors.items())), directory / ADAPTER_WEIGHTS_FILE)

    def finish(partial: Path) -> None:
        for adapter in adapters:
            config = dict(model.adapters[adapter].config or {})
            config["inference_mode"] = True  # as peft saves it
            durable.replace_file(partial / places[adapter] / ADAPTER_CONFIG_FILE,
                                 json.dumps(config, indent=2, sort_keys=True) + "\n")

    write.publish(write_files, finish=finish)
    return Path(out)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file of ``tensors`` (small: an adapter), in their order, as peft writes it."""
    entries = [FileTensor(name, name, tuple(value.shape), value.dtype) for name, value in tensors.items()]
    with open(path, "wb") as handle:
        handle.write(safetensors_header(entries, {"format": "pt"}))
        for value in tensors.values():
            handle.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())


class PeftAdapterSource:
    """A PEFT adapter directory on its base model, as a ``PeftModel`` names its parameters; ``adapter``: the name
    the adapter is loaded under (peft's ``default``). Without ``base``, the adapter's tensors alone (what inspect,
    verify and to-hf's PEFT output need)."""

    def __init__(self, path: Path, base: CheckpointSource | None, adapter: str = "default") -> None:
        self.path, self.base, self.adapter = path, base, adapter
        self.config = read_adapter_config(path / ADAPTER_CONFIG_FILE)
        if self.config.get("peft_type") != "LORA":
            raise CheckpointError(f"{path / ADAPTER_CONFIG_FILE}: a {self.config.get('peft_type')} adapter; "
                                  "deepspeed-ext reads LoRA adapters")
        weights = path / ADAPTER_WEIGHTS_FILE
        if not weights.is_file():
            raise CheckpointError(f"{weights}: missing (a PEFT adapter directory holds adapter_config.json and "
                                  f"{ADAPTER_WEIGHTS_FILE})")
        from safetensors import safe_open
        try:
            with safe_open(str(weights), framework="pt") as handle:
                slices = {key: handle.get_slice(key) for key in handle.keys()}
                self._keys = {key: tuple(piece.get_shape()) for key, piece in slices.items()}
                self._dtypes = {key: torch_dtype(piece.get_dtype()) for key, piece in slices.items()}
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{weights}: not a readable safetensors file: {exc}") from exc
        self._weights = weights
        saved = [str(m) for m in (self.config.get("modules_to_save") or [])]
        self._live = {key: live_name(key, adapter, saved) for key in self._keys}
        model = find_adapters(self._live.values(), {adapter: self.config}, [adapter], with_base=False)
        if model is None:
            raise CheckpointError(f"{weights}: no LoRA weights (lora_A / lora_B) in the adapter")
        self.model = model
        # An adapted embedding's base weights come with the adapter (peft saves them): the adapter's copy is the one
        # peft loads, so it is the one read.
        self._with_adapter = {live for live in self._live.values() if ".base_layer." in live}
        self._base_names = {name: live for name, live in self._base_live_names().items()
                            if live not in self._with_adapter} if base is not None else {}

    def _base_live_names(self) -> dict[str, str]:
        """The base model's parameters under the PeftModel's names (``base_layer``, ``original_module``)."""
        assert self.base is not None
        return self.model.base_live_names(self.base.info.layouts, f"{self.base.info.given} (base of {self.path})")

    @cached_property
    def _adapter_layouts(self) -> dict[str, TPLayout]:
        return {self._live[key]: TPLayout.replicated(shape, 1) for key, shape in self._keys.items()}

    @cached_property
    def info(self) -> SourceInfo:
        base = self.base.info if self.base is not None else None
        layouts = {live: base.layouts[name] for name, live in self._base_names.items()} if base else {}
        layouts.update(self._adapter_layouts)
        return SourceInfo(format="huggingface", given=self.path, path=self.path, layouts=layouts,
                          states=(MASTER_WEIGHTS,), model_config=base.model_config if base else None,
                          model_class="PeftModelForCausalLM", versions={"source": "PEFT adapter + HF base model"},
                          frozen=(*self._base_names.values(), *sorted(self._with_adapter)),
                          adapters={"configs": {self.adapter: self.config}, "active": [self.adapter]})

    @property
    def read_paths(self) -> list[Path]:
        return [self.path, *(self.base.read_paths if self.base is not None else [])]

    def summary(self) -> dict[str, Any]:
        return {"kind": "PEFT adapter", "path": str(self.path),
                "base": str(self.base.info.given) if self.base is not None else "not given (--base)"}

    def raise_if_damaged(self) -> None:
        if self.base is not None:
            self.base.raise_if_damaged()

    def tensors(self) -> Iterator[LogicalTensor]:
        base = {tensor.name: tensor for tensor in self.base.tensors()} if self.base is not None else {}
        for name, live in self._base_names.items():
            tensor = base[name]
            yield LogicalTensor(name=live, shape=tensor.shape, layout=tensor.layout, states=(MASTER_WEIGHTS,),
                                loader=tensor.loader, dtype=tensor.dtype, range_loader=tensor.range_loader,
                                trainable=False)
        from safetensors import safe_open
        for key, live in self._live.items():
            dtype = self._dtypes[key]

            def load(state: str, key: str = key) -> torch.Tensor:
                with safe_open(str(self._weights), framework="pt") as handle:
                    value: torch.Tensor = handle.get_tensor(key)
                return value
            yield LogicalTensor(name=live, shape=self._keys[key], layout=self._adapter_layouts[live],
                                states=(MASTER_WEIGHTS,), loader=load, dtype=dtype,
                                trainable=live not in self._with_adapter)


def adapter_base(path: Path, base: str | Path | None) -> Path | None:
    """The base model of the PEFT adapter at ``path``: ``base``, else the local directory its config names, else
    None (the adapter is read alone)."""
    if base is not None:
        return Path(base)
    named = read_adapter_config(path / ADAPTER_CONFIG_FILE).get("base_model_name_or_path")
    if named and (Path(named) / "config.json").is_file():
        return Path(named)
    return None


def missing_base(source: PeftAdapterSource) -> CheckpointError:
    """What a command that needs the base model's weights says of an adapter read alone."""
    named = source.config.get("base_model_name_or_path")
    return CheckpointError(f"{source.path}: a PEFT adapter (adapter_config.json): its base model's weights are not "
                           f"in it{f' and {named!r} is not a local model directory' if named else ''}; pass --base "
                           "BASE_MODEL_DIR (the HF model the adapter was trained on)")
