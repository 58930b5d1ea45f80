"""A model's Hugging Face config, read by transformers: the config object, the parameters its model has, and
whether a checkpoint's parameters fit it; the dtypes weights are written in.

Every format that names a model by its HF config (to-hf, to-universal from another format, to-maxtext, verify,
compare) checks against it here, so no format module needs another's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from deepspeed_ext.checkpoint.tensor import StreamCheck
from deepspeed_ext.errors import CheckpointError

_T = TypeVar("_T")

DTYPES = ("source", "bfloat16", "float32")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Integer tensors a model holds (DeepSeek-V4's hash-routing table ``tid2eid``): indices, never cast.
_INTEGER_DTYPES = {"int64": torch.int64, "int32": torch.int32}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32"}


def output_dtype(choice: str, source_dtype: torch.dtype) -> torch.dtype:
    """``--dtype``: ``source`` keeps the dtype the source model had; otherwise the named dtype. An integer tensor
    keeps its own (its values are indices, which another dtype would change, not round)."""
    if choice == "source" or (choice in _TORCH_DTYPES and not source_dtype.is_floating_point):
        return source_dtype
    if choice not in _TORCH_DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, not {choice!r}")
    return _TORCH_DTYPES[choice]


def safetensors_dtype_code(dtype: torch.dtype) -> str:
    """The safetensors header's name of ``dtype`` (``F32``, ``BF16``, ``F16``, ``I64``, ``I32``)."""
    return _SAFETENSORS_DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """A dtype from its numpy/torch/safetensors name (``bfloat16``, ``float32``, ``BF16``, ...)."""
    name = str(name).replace("torch.", "")
    by_name = {**_TORCH_DTYPES, **_INTEGER_DTYPES, **{code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}}
    if name not in by_name:
        raise CheckpointError(f"unsupported tensor dtype {name!r} (supported: float32, bfloat16, float16, int64, "
                              "int32)")
    return by_name[name]


def causal_lm_class(model_type: str) -> str | None:
    from deepspeed_ext.checkpoint.transformers_private import causal_lm_class_name
    return causal_lm_class_name(model_type)


def hf_config(model_config: Mapping[str, Any], dtype: torch.dtype | None, source: str) -> Any:
    """The transformers config object of a recorded config dict (validated by transformers itself)."""
    from transformers import AutoConfig
    values = dict(model_config)
    model_type = values.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # whatever transformers raises on a value it cannot take (a dtype it does not know)
        # transformers' validation errors run over several lines (the validator, then the cause): one line here.
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"{source}: the model config is not one transformers knows "
                              f"(model_type {model_type!r}): {reason}") from exc
    if not config.architectures:
        architecture = causal_lm_class(model_type)
        config.architectures = [architecture] if architecture else None
    if dtype is not None:
        config.dtype = dtype
    return config


def _meta_model(config: Any) -> torch.nn.Module:
    """transformers' causal-LM model for ``config``, built on the meta device (no memory). Its class comes from
    transformers' causal-LM mapping and is called directly: ``AutoModelForCausalLM.from_config`` builds the
    same modules but takes over a second more (it settles attention kernels, and imports what that needs), on
    every conversion's path. Raises ``ValueError`` for a model type with no causal-LM class, as it does."""
    from deepspeed_ext.checkpoint.transformers_private import causal_lm_class
    try:
        model_class = causal_lm_class(config)
    except KeyError as exc:
        raise ValueError(f"no causal-LM model for {type(config).__name__}") from exc
    with torch.device("meta"):
        model: torch.nn.Module = model_class(config)
    return model


def _expected_parameters(config: Any) -> dict[str, tuple[int, ...]] | None:
    """The parameters transformers' model for ``config`` has (built on the meta device: no memory)."""
    try:
        model = _meta_model(config)
    except ValueError:
        return None  # a model type with no causal-LM class: nothing to check against
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # Persistent buffers are in the files too (DeepSeek's router bias).
    expected.update((name, tuple(b.shape)) for name, b in persistent_buffers(model).items())
    return expected


def linear_weights(config: Any) -> set[str]:
    """The ``<module>.weight`` names of the ``nn.Linear`` modules of transformers' model for ``config`` (what its
    FP8 quantizer replaces: plain ones, and block-diagonal grouped ones such as DeepSeek-V4's ``o_a_proj``), built
    on the meta device. Modules the model keeps out of quantization
    (``_keep_in_fp32_modules``: DeepSeek-V3.2's indexer ``weights_proj``, DeepSeek-V4's compressor projections,
    which their releases ship unquantized) are left out: transformers' quantizer leaves them ``nn.Linear``, which
    an FP8 weight would not load into."""
    model = _meta_model(config)
    from deepspeed_ext.checkpoint.transformers_private import keep_in_fp32_modules
    kept = keep_in_fp32_modules(model)
    return {f"{name}.weight" for name, module in model.named_modules() if is_quantizable_linear(module)
            and not any(name == key or name.endswith("." + key) for key in kept)}


def is_quantizable_linear(module: torch.nn.Module) -> bool:
    """A linear layer transformers' FP8 quantizer replaces: an ``nn.Linear``, or a subclass of it that is a
    block-diagonal grouped linear (its FP8 form keeps the groups)."""
    return type(module) is torch.nn.Linear or (isinstance(module, torch.nn.Linear)
                                               and "GroupedLinear" in type(module).__name__)


def shapes_mismatch(expected: Mapping[str, tuple[int, ...]], have: Mapping[str, tuple[int, ...]],
                    expected_says: str) -> str | None:
    """The first way names/shapes ``have`` differ from ``expected`` (missing, unexpected, a wrong shape, where
    ``expected_says`` introduces the expected shape), or None."""
    if dict(have) == dict(expected):
        return None
    missing, extra = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
    wrong = sorted(n for n in set(have) & set(expected) if have[n] != expected[n])
    return (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra else
            f"{wrong[0]} is {list(have[wrong[0]])}, {expected_says} {list(expected[wrong[0]])}")


#: ``DEEPSPEED_EXT_CACHE_DIR``: where what transformers says about a model config is kept between commands
#: (default ``$XDG_CACHE_HOME/deepspeed-ext``, else ``~/.cache/deepspeed-ext``); ``off`` keeps nothing.
CACHE_DIR_ENV = "DEEPSPEED_EXT_CACHE_DIR"
#: Raised whenever :class:`ConfigFacts` or what goes into it changes: older entries are then never read.
_FACTS_FORMAT = 1


@dataclass(frozen=True)
class ConfigFacts:
    """What a conversion takes from transformers about one model config (at one dtype), found by transformers
    itself: the files its ``save_pretrained`` writes and the parameters its causal-LM model has.

    Finding them imports transformers' configuration and model code: 2-4 s of a command's start on a small
    machine, longer than converting a small checkpoint takes. They depend only on the config, the dtype and the
    transformers release, so they are kept (JSON, one file per config) in the user's cache directory
    (:data:`CACHE_DIR_ENV`) and later commands on a model of that config import no transformers at all.
    """

    #: The name of transformers' config class (``LlamaConfig``), for messages.
    config_class: str
    #: ``config.json`` as ``save_pretrained`` writes it.
    config_json: str
    #: ``generation_config.json`` as ``save_pretrained`` writes it for a causal LM; None for other models.
    generation_config_json: str | None
    #: Parameter (and persistent buffer) names and shapes of transformers' causal-LM model; None where the
    #: model type has no causal-LM class (nothing to check against).
    parameters: dict[str, tuple[int, ...]] | None

    def mismatch(self, have: Mapping[str, tuple[int, ...]]) -> str | None:
        """How names/shapes ``have`` fail to fit the model; None if they fit."""
        detail = None if self.parameters is None else shapes_mismatch(self.parameters, have, "the config says")
        return None if detail is None else f"parameters do not fit {self.config_class}'s model ({detail})"


def config_facts(model_config: Mapping[str, Any], dtype: torch.dtype | None, source: str) -> ConfigFacts:
    """:class:`ConfigFacts` of ``model_config`` at ``dtype``: from the cache where an earlier command found
    them with this transformers release, else from transformers (and kept for the next command)."""
    entry = _facts_entry(model_config, dtype)
    if entry is not None and (facts := _read_facts(entry)) is not None:
        return facts
    config = hf_config(model_config, dtype, source)
    with tempfile.TemporaryDirectory(prefix="deepspeed-ext-config-") as scratch:
        config.save_pretrained(scratch)
        config_json = Path(scratch, "config.json").read_text()
        generation_json = None
        if config.architectures and any(name.endswith("ForCausalLM") for name in config.architectures):
            from transformers import GenerationConfig
            GenerationConfig.from_model_config(config).save_pretrained(scratch)
            generation_json = Path(scratch, "generation_config.json").read_text()
    facts = ConfigFacts(type(config).__name__, config_json, generation_json, _expected_parameters(config))
    if entry is not None:
        _write_facts(entry, facts)
    return facts


def _facts_entry(model_config: Mapping[str, Any], dtype: torch.dtype | None) -> Path | None:
    """The cache file of this config at this dtype with the installed transformers; None without a cache."""
    from importlib.metadata import PackageNotFoundError, version
    directory = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "deepspeed-ext")
    if directory == "off":
        return None
    try:
        transformers_version = version("transformers")
    except PackageNotFoundError:
        return None  # transformers' own import names what is missing
    key = json.dumps({"format": _FACTS_FORMAT, "transformers": transformers_version, "dtype": str(dtype),
                      "config": model_config}, sort_keys=True, default=str)
    return Path(directory, "model-configs", hashlib.sha256(key.encode()).hexdigest() + ".json")


def _read_facts(path: Path) -> ConfigFacts | None:
    """The facts kept at ``path``; None where there are none, or what is there is not a whole entry (then
    transformers is asked again and the entry rewritten)."""
    try:
        kept = json.loads(path.read_text())
        parameters = kept["parameters"]
        return ConfigFacts(str(kept["config_class"]), str(kept["config_json"]),
                           None if kept["generation_config_json"] is None else str(kept["generation_config_json"]),
                           None if parameters is None else
                           {str(name): tuple(int(n) for n in shape) for name, shape in parameters.items()})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _write_facts(path: Path, facts: ConfigFacts) -> None:
    """Keep ``facts`` at ``path`` (whole or not at all: written aside, then renamed); a cache that cannot be
    written (read-only home, full disk) is skipped: it only saves time."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(handle, "w") as out:
            json.dump({"config_class": facts.config_class, "config_json": facts.config_json,
                       "generation_config_json": facts.generation_config_json,
                       "parameters": facts.parameters}, out)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class ConfigFit(StreamCheck):
    """Whether a checkpoint's parameters fit transformers' model for its config, found on a thread.

    Finding it (:func:`config_facts`) takes seconds where transformers must be imported; a writer starts this
    first and streams tensors meanwhile (torch's kernels and file I/O release the GIL). Each tensor read polls it
    (:meth:`stream`, :meth:`loader`), so a wrong config still stops the conversion within seconds of its start,
    and the writer takes :meth:`result` (the config's :class:`ConfigFacts`) before it publishes anything.
    """

    blockwise = True

    def __init__(self, model_config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str,
                 dtype: torch.dtype | None = None):
        from concurrent.futures import ThreadPoolExecutor
        self._model_config, self._dtype, self._source = dict(model_config), dtype, source
        executor = ThreadPoolExecutor(1, thread_name_prefix="deepspeed-ext-config-check")
        self._future = executor.submit(self._fits, dict(shapes))
        executor.shutdown(wait=False)

    def _fits(self, shapes: dict[str, tuple[int, ...]]) -> ConfigFacts:
        facts = config_facts(self._model_config, self._dtype, self._source)
        mismatch = facts.mismatch(shapes)
        if mismatch:
            raise CheckpointError(f"{self._source}: {mismatch}; wrong --config?")
        return facts

    def config(self) -> Any:
        """transformers' config object itself (imports transformers), once the parameters fit it."""
        self.result()
        return hf_config(self._model_config, self._dtype, self._source)

    def poll(self) -> None:
        """Raise the check's error if it has found one by now."""
        if self._future.done():
            self._future.result()

    def result(self) -> ConfigFacts:
        """What transformers says of the config, once the parameters are known to fit it (or the error saying
        why not)."""
        return self._future.result()

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        """A conversion error raised inside waits for this check and gives way to its error: a config that does
        not fit the parameters is the cause to name, not what went wrong downstream of it."""
        try:
            yield
        except CheckpointError:
            self.result()
            raise

    def check(self, name: str, state: str, value: _T) -> _T:
        self.poll()
        return value


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that its state dict saves (DeepSeek-V3's router ``e_score_correction_bias``,
    DeepSeek-V4's int64 hash-routing table ``tid2eid``): model state no optimizer steps, which checkpoints carry as
    tensors in their own dtype."""
    persistent = set(module.state_dict(keep_vars=True))
    return {name: buffer for name, buffer in module.named_buffers() if name in persistent}
