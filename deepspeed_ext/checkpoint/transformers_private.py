"""transformers' internals deepspeed-ext reads, fenced: its causal-LM class mappings (``modeling_auto``) and the
modules a model keeps out of quantization (``_keep_in_fp32_modules``), which
are not part of its documented API. (What deepspeed-ext patches of transformers and Accelerate at ``enable`` is
the runtime's, in its own fence: :mod:`deepspeed_ext.runtime.integrations`.)

:func:`check_installed_transformers` names, in one line, any of these that the installed transformers lacks; the
functions here run it before they read them.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from deepspeed_ext.errors import DeepSpeedExtError

_MODELING_AUTO = "transformers.models.auto.modeling_auto"
#: What the functions below read of transformers' ``modeling_auto``.
_REQUIRED = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING")


@functools.cache
def check_installed_transformers() -> Any:
    """transformers' ``modeling_auto`` module, checked to have what is read of it (once per process); one line
    naming what is missing otherwise."""
    try:
        module = importlib.import_module(_MODELING_AUTO)
    except ImportError as exc:
        raise DeepSpeedExtError(f"this transformers has no {_MODELING_AUTO} ({exc}), whose causal-LM mappings "
                                "deepspeed-ext reads") from exc
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    if missing:
        import transformers
        raise DeepSpeedExtError(f"transformers {transformers.__version__} lacks {_MODELING_AUTO}."
                                f"{', '.join(missing)}, which deepspeed-ext reads to find a model type's causal-LM "
                                "class (deepspeed_ext/checkpoint/transformers_private.py)")
    return module


def causal_lm_class_name(model_type: str) -> str | None:
    """The name of transformers' causal-LM class for ``model_type`` (``LlamaForCausalLM``), None if it has none."""
    name: str | None = check_installed_transformers().MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name


def causal_lm_class(config: Any) -> Any:
    """transformers' causal-LM class for a config object; ``KeyError`` where there is none."""
    return check_installed_transformers().MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def keep_in_fp32_modules(model: Any) -> tuple[str, ...]:
    """The module names a transformers model keeps out of quantization (its class attribute
    ``_keep_in_fp32_modules``, which its quantizers read; not documented API): empty where it has none."""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
