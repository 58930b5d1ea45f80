"""Loading in MaxText: the MaxText settings (``KEY=VALUE`` overrides) that build the model of an HF config for a
checkpoint written with a family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepspeed_ext.checkpoint.families import Family
from deepspeed_ext.checkpoint.maxtext.transforms import ModelDims


def _rope_theta(config: Mapping[str, Any]) -> float | None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, Mapping) and isinstance(rope.get("full_attention"), Mapping):
        rope = rope["full_attention"]  # per layer type (gemma3): the global layers' RoPE
    theta = (rope.get("rope_theta") if isinstance(rope, Mapping) else None) or config.get("rope_theta")
    return float(theta) if theta is not None else None


def maxtext_settings(family: Family, config: Mapping[str, Any], scan_layers: bool = True) -> dict[str, Any]:
    """The MaxText config (``KEY=VALUE`` overrides) that builds the model of HF ``config`` for a checkpoint
    written with ``family``: the family's MaxText model_name with the sizes overridden
    (``override_model_config``), and the family's own switches. MaxText's own model code is run with exactly
    these in tests/e2e/test_maxtext_model_code.py."""
    dims = ModelDims.from_config(config)
    settings: dict[str, Any] = {
        "model_name": family.maxtext_model, "override_model_config": True, "scan_layers": scan_layers,
        "base_emb_dim": dims.hidden_size, "base_num_query_heads": dims.num_heads,
        "base_num_kv_heads": int(config.get("num_key_value_heads") or dims.num_heads), "head_dim": dims.head_dim,
        "base_mlp_dim": config.get("intermediate_size"), "base_num_decoder_layers": dims.num_layers,
        "vocab_size": config.get("vocab_size"), "normalization_layer_epsilon": config.get("rms_norm_eps"),
        "logits_via_embedding": dims.tied,
        # Tied logits are x @ embedding.T as transformers computes them; gemma3 (which MaxText stores
        # pre-scaled) turns the 1/sqrt(hidden) normalization back on.
        "normalize_embedding_logits": False if dims.tied else None,
    }
    theta = _rope_theta(config)
    if theta is not None:
        settings["rope_max_timescale"] = int(theta) if float(theta).is_integer() else theta
    if family.maxtext_extra is not None:
        settings.update(family.maxtext_extra(config))
    return {key: value for key, value in settings.items() if value is not None}


def settings_text(settings: Mapping[str, Any]) -> str:
    """``KEY=VALUE ...`` as MaxText's command line takes them (booleans as true/false)."""
    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(text(v) for v in value) + "]"
        return str(value)
    return " ".join(f"{key}={text(value)}" for key, value in settings.items())


def adamw_settings(lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.01, steps: int | None = None,
                   gradient_clipping: float | None = None) -> dict[str, Any]:
    """The MaxText settings under which its ``opt_type=adamw`` continues a DeepSpeed run of torch's AdamW
    (DeepSpeed's ``"type": "Adam"``/``"AdamW"``; torch's default ``weight_decay`` is 0.01) at a constant
    learning rate ``lr``: the same betas and epsilon (outside the square root), decoupled weight decay on every
    parameter (MaxText's default ``adamw_mask`` is empty, as DeepSpeed decays every group it was given), no warmup
    and a final fraction of 1 (MaxText's schedule is then constant: the step count it restores selects the same
    rate), and DeepSpeed's ``gradient_clipping`` (0: none). ``steps``: where the MaxText run stops. MaxText's own
    defaults differ: b2 0.95, weight decay 0.1, a warmup and a cosine decay."""
    settings: dict[str, Any] = {
        "opt_type": "adamw", "learning_rate": lr, "adam_b1": betas[0], "adam_b2": betas[1], "adam_eps": eps,
        "adam_eps_root": 0.0, "adam_weight_decay": weight_decay, "warmup_steps_fraction": 0.0,
        "learning_rate_final_fraction": 1.0, "gradient_clipping_threshold": gradient_clipping or 0.0,
    }
    if steps is not None:
        settings["steps"] = steps
    return settings
