"""peft adapters in a checkpoint: which parameters are LoRA adapters, of which base weight, with which settings.

A model wrapped by peft (``get_peft_model``, or transformers' ``add_adapter``) names its parameters so:

* a targeted layer ``M`` keeps its own weight as ``M.base_layer.weight`` (frozen) and gains ``M.lora_A.<adapter>
  .weight`` (r x in) and ``M.lora_B.<adapter>.weight`` (out x r) per adapter; an embedding gains ``M.lora_embedding_A
  .<adapter>`` (r x vocab) and ``M.lora_embedding_B.<adapter>`` (dim x r); DoRA adds ``M.lora_magnitude_vector
  .<adapter>.weight`` (out); ``lora_bias`` adds ``M.lora_B.<adapter>.bias``;
* a module in ``modules_to_save`` keeps its weights as ``M.original_module.<k>`` (frozen) and trains a copy, ``M
  .modules_to_save.<adapter>.<k>``;
* a ``PeftModel`` puts ``base_model.model.`` before every name; transformers' own integration does not.

Nothing here imports peft: a checkpoint is recognised by these names alone, and its settings (rank, alpha, rsLoRA,
DoRA, per-module patterns) come from the peft config recorded with it (deepspeed-ext records every adapter's at
save time), from an ``adapter_config.json`` beside it, or from the user. What peft writes for an adapter
(``save_pretrained``: the adapter name left out of every key, DoRA's magnitude without ``.weight``, a saved
module under the module's own name) is :func:`peft_key`; :func:`live_name` is its inverse.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed_ext.errors import CheckpointError

#: What a ``PeftModel`` puts before the wrapped model's parameter names.
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: The layers whose base weights peft saves with an adapter that adapts them (a vocabulary may have been resized).
EMBEDDING_LAYERS = ("embed_tokens", "lm_head")

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)\.(?P<adapter>[^.]+)\.(?P<key>weight|bias)$")
_LORA_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<part>A|B)\.(?P<adapter>[^.]+)$")
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector\.(?P<adapter>[^.]+)\.weight$")
_SAVED_COPY = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<key>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<key>.+)$")
_BASE_LAYER = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<key>.+)$")


@dataclass(frozen=True)
class LoraSettings:
    """One adapter's peft LoRA config, as far as the weights depend on it."""

    name: str
    #: The peft config as ``adapter_config.json`` holds it (None: not known; the adapter's weights are still
    #: read and written, but nothing that needs its scale can be done).
    config: Mapping[str, Any] | None

    @property
    def known(self) -> bool:
        return self.config is not None

    def _config(self, what: str) -> Mapping[str, Any]:
        if self.config is None:
            raise CheckpointError(f"adapter {self.name!r}: its peft config (lora_alpha, ...) is not recorded with the "
                                  f"checkpoint; {what} needs it: pass --adapter-config adapter_config.json")
        return self.config

    @property
    def peft_type(self) -> str:
        return str((self.config or {}).get("peft_type", "LORA"))

    @property
    def use_dora(self) -> bool:
        return bool((self.config or {}).get("use_dora"))

    @property
    def fan_in_fan_out(self) -> bool:
        return bool((self.config or {}).get("fan_in_fan_out"))

    def scaling(self, module: str, rank: int) -> float:
        """peft's scale of ``B @ A`` for ``module`` (the wrapped model's name): ``alpha / r``, rsLoRA ``alpha /
        sqrt(r)``; ``alpha_pattern`` picks a module's own alpha. ``rank``: the adapter's rank there (its lora_A's
        rows: ``rank_pattern`` already applied)."""
        config = self._config("merging")
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    def describe(self) -> str:
        if self.config is None:
            return f"{self.name}: settings not recorded"
        config = self.config
        targets = config.get("target_modules")
        if isinstance(targets, (list, tuple, set)):  # peft expands "all-linear" into every module's full name
            leaves = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
            targets = ", ".join(leaves) + (f" ({len(targets)} modules)" if len(leaves) < len(targets) else "")
        extras = [word for word, on in (("rsLoRA", config.get("use_rslora")), ("DoRA", config.get("use_dora"))) if on]
        saved = config.get("modules_to_save")
        return (f"{self.name}: {self.peft_type} r={config.get('r')} alpha={config.get('lora_alpha')}"
                f"{' ' + ' '.join(extras) if extras else ''}, targets {targets}"
                + (f", modules_to_save {', '.join(saved)}" if saved else ""))


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """peft's per-module override: the first pattern that is the module's name or a dotted suffix of it (a regular
    expression, as peft matches them)."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            return value
    return default


@dataclass
class LoraModule:
    """One targeted layer: its frozen base weight and each adapter's parameters (checkpoint names)."""

    module: str  #: the layer's name in the checkpoint (with peft's prefix, where it has one)
    base: dict[str, str] = field(default_factory=dict)  #: key (weight, bias) -> the base layer's parameter
    embedding: bool = False
    a: dict[str, str] = field(default_factory=dict)  #: adapter -> lora_A's weight
    b: dict[str, str] = field(default_factory=dict)
    b_bias: dict[str, str] = field(default_factory=dict)
    magnitude: dict[str, str] = field(default_factory=dict)


@dataclass
class SavedModule:
    """A module in ``modules_to_save``: its frozen original and each adapter's trained copy (checkpoint names)."""

    module: str
    original: dict[str, str] = field(default_factory=dict)  #: key -> name
    copies: dict[str, dict[str, str]] = field(default_factory=dict)  #: adapter -> key -> name


@dataclass
class AdapterModel:
    """The adapter structure of a checkpoint's parameter names."""

    #: ``base_model.model.`` (a PeftModel's names) or "" (transformers' integration).
    prefix: str
    adapters: dict[str, LoraSettings]
    lora: dict[str, LoraModule]
    saved: dict[str, SavedModule]
    #: Every other parameter: the base model's own (name in the checkpoint -> the wrapped model's name).
    plain: dict[str, str]
    active: tuple[str, ...] = ()

    def parameters_of(self, adapter: str) -> list[str]:
        """The checkpoint names of what ``adapter``'s PEFT adapter holds: its own parameters, and, as peft saves
        them, the base weights of an embedding layer it adapts (``embed_tokens``, ``lm_head``)."""
        names = []
        for module in self.lora.values():
            for part in (module.a, module.b, module.b_bias, module.magnitude):
                if adapter in part:
                    names.append(part[adapter])
            if adapter in module.a and module.module.rsplit(".", 1)[-1] in EMBEDDING_LAYERS:
                names += module.base.values()
        for saved in self.saved.values():
            names += saved.copies.get(adapter, {}).values()
        return names

    def choose(self, wanted: Iterable[str], label: str) -> list[str]:
        """The adapters named (none: the active ones, else all), each checked to exist."""
        wanted = list(wanted)
        for name in wanted:
            if name not in self.adapters:
                raise CheckpointError(f"{label}: no adapter {name!r} in this checkpoint (it has "
                                      f"{', '.join(sorted(self.adapters))}); pass --adapter with one of them")
        if wanted:
            return wanted
        active = [name for name in self.active if name in self.adapters]
        return active or sorted(self.adapters)

    def unwrapped(self, name: str) -> str:
        return name[len(self.prefix):] if name.startswith(self.prefix) else name

    def base_saved(self, label: str) -> bool:
        """Whether the checkpoint holds its adapted layers' base weights: all (True) or none (False: saved without its
        frozen parameters, as the Trainer saves a peft model); one line where only some are there."""
        without = [module.module for module in self.lora.values() if "weight" not in module.base]
        if without and len(without) < len(self.lora):
            raise CheckpointError(f"{label}: {without[0]}: LoRA adapters without the base layer's weight "
                                  f"({without[0]}.base_layer.weight), which other adapted layers have")
        return not without

    def base_live_names(self, base_names: Iterable[str], label: str) -> dict[str, str]:
        """A base model's parameter names -> the adapted model's: a targeted layer's as ``base_layer``, a module saved
        whole as ``original_module``, each under this model's prefix. One line naming a layer the base lacks."""
        lora = {self.unwrapped(module) for module in self.lora}
        saved = {self.unwrapped(module) for module in self.saved}
        base_names = list(base_names)
        found: dict[str, str] = {}
        for name in base_names:
            module, _, leaf = name.rpartition(".")
            if module in lora:
                found[name] = f"{self.prefix}{module}.base_layer.{leaf}"
            elif module in saved:
                found[name] = f"{self.prefix}{module}.original_module.{leaf}"
            else:
                found[name] = self.prefix + name
        missing = [m for m in sorted(lora | saved) if not any(n.startswith(m + ".") for n in base_names)]
        if missing:
            raise CheckpointError(f"{label}: the base model has no {missing[0]!r}, which the adapter adapts; wrong "
                                  "--base?")
        return found

    def summary(self) -> dict[str, Any]:
        """What ``inspect`` says of the adapters."""
        trainable = {n for adapter in self.adapters for n in self.parameters_of(adapter)}
        modules = sorted({self.unwrapped(m).rsplit(".", 1)[-1] for m in self.lora})
        return {"adapters": [settings.describe() for settings in self.adapters.values()],
                "adapter_base_model": ("a peft PeftModel (names under base_model.model.)" if self.prefix else
                                       "a model with peft adapters added in place (transformers' add_adapter)"),
                "adapted_modules": f"{len(self.lora)} layers ({', '.join(modules)})"
                                   + (f"; {len(self.saved)} modules saved whole" if self.saved else ""),
                "adapter_parameters": f"{len(trainable)} adapter tensors; the rest is the frozen base model",
                "adapter_exports": "to-hf writes the PEFT adapter (PeftModel.from_pretrained(base, OUT)); to-hf "
                                   "--merge the merged model; to-maxtext the merged weights"
                                   + ("" if self.base_saved("") else " (both with --base BASE_MODEL_DIR: the "
                                      "checkpoint holds the adapters alone, its frozen base weights were not saved)")}


def find_adapters(names: Iterable[str], configs: Mapping[str, Mapping[str, Any] | None] | None = None,
                  active: Iterable[str] = (), with_base: bool = True) -> AdapterModel | None:
    """The adapter structure of a checkpoint whose parameters are ``names`` (None: no adapters). ``configs``: each
    adapter's peft config where known (an adapter found in the names without one gets ``config=None``).
    ``with_base``: the names are a whole model's (each adapted layer's base weight is among them), not an adapter
    file's."""
    names = list(names)
    lora: dict[str, LoraModule] = {}
    saved: dict[str, SavedModule] = {}
    found: list[str] = []
    rest: list[str] = []
    for name in names:
        if match := _LORA.match(name):
            module = lora.setdefault(match["module"], LoraModule(match["module"]))
            target = module.a if match["part"] == "A" else module.b if match["key"] == "weight" else module.b_bias
            if match["part"] == "A" and match["key"] == "bias":
                target = module.b_bias  # never written by peft (lora_A has no bias), kept beside lora_B's
            target[match["adapter"]] = name
        elif match := _LORA_EMBEDDING.match(name):
            module = lora.setdefault(match["module"], LoraModule(match["module"], embedding=True))
            module.embedding = True
            (module.a if match["part"] == "A" else module.b)[match["adapter"]] = name
        elif match := _MAGNITUDE.match(name):
            lora.setdefault(match["module"], LoraModule(match["module"])).magnitude[match["adapter"]] = name
        elif match := _SAVED_COPY.match(name):
            saved.setdefault(match["module"], SavedModule(match["module"])).copies.setdefault(
                match["adapter"], {})[match["key"]] = name
        elif match := _ORIGINAL.match(name):
            saved.setdefault(match["module"], SavedModule(match["module"])).original[match["key"]] = name
        else:
            rest.append(name)
            continue
        found.append(match["adapter"] if "adapter" in match.groupdict() else "")
    if not lora and not any(s.copies for s in saved.values()):
        return None
    plain: dict[str, str] = {}
    for name in rest:
        match = _BASE_LAYER.match(name)
        if match and match["module"] in lora:
            lora[match["module"]].base[match["key"]] = name
        else:
            plain[name] = name
    prefix = PEFT_PREFIX if all(n.startswith(PEFT_PREFIX) for n in names) else ""
    adapter_names = sorted({a for a in found if a} | set((configs or {})))
    adapters = {a: LoraSettings(a, (configs or {}).get(a)) for a in adapter_names}
    model = AdapterModel(prefix, adapters, lora, saved, {}, tuple(active))
    model.plain = {name: model.unwrapped(name) for name in plain}
    for module in lora.values() if with_base else ():
        if "weight" not in module.base:
            raise CheckpointError(f"{module.module}: LoRA adapters without the base layer's weight "
                                  f"({module.module}.base_layer.weight) in the checkpoint")
    return model


def is_lora_factor(name: str) -> bool:
    """Whether ``name`` is a LoRA factor (``lora_A``/``lora_B``, or an embedding's): r rows or columns, which a
    tensor-parallel run keeps whole on every rank on one side of each layer by design."""
    return bool(_LORA.match(name) or _LORA_EMBEDDING.match(name))


def peft_key(name: str, adapter: str, prefix: str) -> str:
    """The key peft's ``save_pretrained`` writes ``adapter``'s parameter ``name`` under (``prefix``: the
    checkpoint's; the file's keys always start with ``base_model.model.``)."""
    if match := _SAVED_COPY.match(name):
        key = f"{match['module']}.{match['key']}"
    elif match := _MAGNITUDE.match(name):
        key = f"{match['module']}.lora_magnitude_vector"  # peft keeps DoRA's pre-refactor key
    else:
        key = name.replace(f".{adapter}.", ".") if f".{adapter}." in name else name.removesuffix(f".{adapter}")
    return key if prefix else PEFT_PREFIX + key


def live_name(key: str, adapter: str, saved_modules: Iterable[str] = ()) -> str:
    """The parameter a ``PeftModel`` has for key ``key`` of a PEFT adapter file, loaded as ``adapter``:
    :func:`peft_key`'s inverse. ``saved_modules``: the modules the config saves whole (their keys carry no
    marker)."""
    for part in ("lora_A", "lora_B"):
        if f".{part}." in key:
            return key.replace(f".{part}.", f".{part}.{adapter}.")
    for part in ("lora_embedding_A", "lora_embedding_B"):
        if key.endswith(f".{part}"):
            return f"{key}.{adapter}"
    if key.endswith(".lora_magnitude_vector"):
        return f"{key}.{adapter}.weight"
    module, _, leaf = key.rpartition(".")
    if any(re.fullmatch(rf"(.*\.)?{re.escape(saved)}", module) for saved in saved_modules):
        return f"{module}.modules_to_save.{adapter}.{leaf}"
    return key


def peft_config_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """A peft config's ``to_dict()`` as ``adapter_config.json`` holds it (sets as sorted lists, enums as their
    values); the config of a training run is recorded so."""
    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(plain(v) for v in value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if hasattr(value, "value") and type(value).__module__.startswith("peft"):
            return value.value
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        return str(value)
    return {key: plain(value) for key, value in config.items()}


def read_adapter_config(path: Path) -> dict[str, Any]:
    """An ``adapter_config.json``, or one line naming it."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the adapter config: {exc}") from exc
    if not isinstance(config, dict) or "peft_type" not in config:
        raise CheckpointError(f"{path}: not a peft adapter config (no peft_type)")
    return config


def adapters_beside(directory: Path) -> dict[str, Any] | None:
    """The adapters a PEFT ``save_pretrained`` left in ``directory`` (a Trainer's ``checkpoint-N`` holds the
    adapter beside the DeepSpeed tag): ``default`` at its root, any other adapter in a folder of its name."""
    configs: dict[str, Any] = {}
    if (directory / ADAPTER_CONFIG_FILE).is_file():
        configs["default"] = read_adapter_config(directory / ADAPTER_CONFIG_FILE)
    try:
        folders = [p for p in directory.iterdir() if p.is_dir() and (p / ADAPTER_CONFIG_FILE).is_file()]
    except OSError:
        folders = []
    for folder in sorted(folders):
        configs[folder.name] = read_adapter_config(folder / ADAPTER_CONFIG_FILE)
    return {"configs": configs, "active": ["default"] if "default" in configs else []} if configs else None
