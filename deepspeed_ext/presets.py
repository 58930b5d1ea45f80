"""DeepSpeed AutoTP and AutoEP settings per model family: the keys a DeepSpeed config's ``"tensor_parallel"``
section needs for the family to initialize and train with AutoTP, and its AutoEP preset (docs/support-matrix.md
lists them).

Each comes from the family's file under :mod:`deepspeed_ext.checkpoint.families` and is used as it is by the
end-to-end tests. A family without one trains with AutoTP's defaults (transformers' own tp_plan).
"""

from __future__ import annotations

import copy
from typing import Any


def tensor_parallel_preset(family: str) -> dict[str, Any]:
    """The keys to merge into the ``"tensor_parallel"`` section for ``family`` (``mixtral``, ``qwen3-moe``, ...;
    the HF spelling ``qwen3_moe`` works too); ``{}`` when AutoTP's defaults work::

        ds_config["tensor_parallel"] = {"autotp_size": 2, **deepspeed_ext.tensor_parallel_preset("mixtral")}
    """
    from deepspeed_ext.checkpoint.families import get_family
    return copy.deepcopy(dict(get_family(family).tensor_parallel or {}))


def expert_parallel_preset(family: str) -> dict[str, Any]:
    """The keys to merge into the ``"expert_parallel"`` section (DeepSpeed AutoEP) for an MoE ``family``: the
    AutoEP ``preset_model`` for it. Refused for a family AutoEP has no preset for::

        ds_config["expert_parallel"] = {"enabled": True, "autoep_size": 2,
                                        **deepspeed_ext.expert_parallel_preset("mixtral")}
    """
    from deepspeed_ext.checkpoint.families import get_family
    preset = get_family(family).expert_parallel
    if preset is None:
        raise ValueError(f"family {family!r} has no DeepSpeed AutoEP preset (AutoEP serves MoE families: "
                         "mixtral, qwen3-moe, deepseek-v3)")
    return {"preset_model": preset}
