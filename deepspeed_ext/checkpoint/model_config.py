"""A model's Hugging Face config, read by transformers: the config object, the parameters its model has, and
whether a checkpoint's parameters fit it; the dtypes weights are written in.

Every format that names a model by its HF config (to-hf, to-universal from another format, to-maxtext, verify,
compare) checks against it here, so no format module needs another's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from deepspeed_ext.checkpoint.tensor import StreamCheck
from deepspeed_ext.errors import CheckpointError

_T = TypeVar("_T")

DTYPES = ("source", "bfloat16", "float32")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def output_dtype(choice: str, source_dtype: torch.dtype) -> torch.dtype:
    """``--dtype``: ``source`` keeps the dtype the source model had; otherwise the named dtype."""
    if choice == "source":
        return source_dtype
    if choice not in _TORCH_DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, not {choice!r}")
    return _TORCH_DTYPES[choice]


def safetensors_dtype_code(dtype: torch.dtype) -> str:
    """The safetensors header's name of ``dtype`` (``F32``, ``BF16``, ``F16``)."""
    return _SAFETENSORS_DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """A dtype from its numpy/torch/safetensors name (``bfloat16``, ``float32``, ``BF16``, ...)."""
    name = str(name).replace("torch.", "")
    by_name = {**_TORCH_DTYPES, **{code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}}
    if name not in by_name:
        raise CheckpointError(f"unsupported tensor dtype {name!r} (supported: float32, bfloat16, float16)")
    return by_name[name]


def causal_lm_class(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name: str | None = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name


def hf_config(model_config: Mapping[str, Any], dtype: torch.dtype | None, source: str) -> Any:
    """The transformers config object of a recorded config dict (validated by transformers itself)."""
    from transformers import AutoConfig
    values = dict(model_config)
    model_type = values.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # whatever transformers raises on a value it cannot take (a dtype it does not know)
        raise CheckpointError(f"{source}: the model config is not one transformers knows "
                              f"(model_type {model_type!r}): {exc}") from exc
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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
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
    FP8 quantizer replaces), built on the meta device."""
    model = _meta_model(config)
    return {f"{name}.weight" for name, module in model.named_modules() if type(module) is torch.nn.Linear}


def parameter_mismatch(config: Any, have: Mapping[str, tuple[int, ...]]) -> str | None:
    """How parameter names/shapes ``have`` fail to fit transformers' model for ``config``; None if they fit."""
    expected = _expected_parameters(config)
    detail = None if expected is None else shapes_mismatch(expected, have, "the config says")
    return None if detail is None else f"parameters do not fit {type(config).__name__}'s model ({detail})"


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


def check_fits_config(config: Any, have: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Refuse parameters that do not fit the model ``config`` describes (``config``: a transformers config or
    a config dict), naming the first that does not."""
    if isinstance(config, Mapping):
        config = hf_config(config, None, source)
    mismatch = parameter_mismatch(config, have)
    if mismatch:
        raise CheckpointError(f"{source}: {mismatch}; wrong --config?")


class ConfigFit(StreamCheck):
    """Whether a checkpoint's parameters fit transformers' model for its config, found on a thread.

    Importing transformers' config and model code and building the model on the meta device takes about a
    second of a command's start; a writer starts this first and streams tensors meanwhile (torch's kernels and file I/O
    release the GIL). Each tensor read polls it (:meth:`stream`, :meth:`loader`), so a wrong config still
    stops the conversion within seconds of its start, and the writer takes :meth:`result` (transformers'
    config) before it publishes anything.
    """

    blockwise = True

    def __init__(self, model_config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str,
                 dtype: torch.dtype | None = None):
        from concurrent.futures import ThreadPoolExecutor
        executor = ThreadPoolExecutor(1, thread_name_prefix="deepspeed-ext-config-check")
        self._future = executor.submit(self._fits, dict(model_config), dict(shapes), source, dtype)
        executor.shutdown(wait=False)

    @staticmethod
    def _fits(model_config: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str,
               dtype: torch.dtype | None) -> Any:
        config = hf_config(model_config, dtype, source)
        check_fits_config(config, shapes, source)
        return config

    def poll(self) -> None:
        """Raise the check's error if it has found one by now."""
        if self._future.done():
            self._future.result()

    def result(self) -> Any:
        """transformers' config, once the parameters are known to fit it (or the error saying why not)."""
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
    """The module's floating-point buffers that its state dict saves (DeepSeek-V3's router
    ``e_score_correction_bias``): model state no optimizer steps, which checkpoints carry as tensors."""
    persistent = set(module.state_dict(keep_vars=True))
    return {name: buffer for name, buffer in module.named_buffers()
            if name in persistent and buffer.is_floating_point()}
