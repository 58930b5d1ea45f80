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
    rate), and DeepSpeed's ``gradient_clipping`` as the engine ran it (0: none). ``steps``: where the MaxText run stops. MaxText's own
    defaults differ: b2 0.95, weight decay 0.1, a warmup and a cosine decay."""
    settings: dict[str, Any] = {
        "opt_type": "adamw", "learning_rate": lr, "adam_b1": betas[0], "adam_b2": betas[1], "adam_eps": eps,
        "adam_eps_root": 0.0, "adam_weight_decay": weight_decay, "warmup_steps_fraction": 0.0,
        "learning_rate_final_fraction": 1.0, "gradient_clipping_threshold": gradient_clipping or 0.0,
    }
    if steps is not None:
        settings["steps"] = steps
    return settings


#: DeepSpeed's precision -> MaxText's ``dtype`` (its activations' and compute's).
MAXTEXT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def continuation_settings(saved: Mapping[str, Any] | None, global_step: int, dp_degree: int = 1,
                          family: Family | None = None,
                          model_config: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """MaxText's optimizer settings that continue the DeepSpeed run a checkpoint saved (``saved``: its
    :attr:`~deepspeed_ext.checkpoint.source.SourceInfo.optimizer_settings`), and notes on what they cannot express
    or what the user must still set. ``global_step``: where the run stands; ``dp_degree``: its data-parallel size
    (with the micro batch and the accumulation steps, the global batch MaxText must take); ``family`` and
    ``model_config``: the model, for the differences MaxText's own model code makes (docs/maxtext.md)."""
    notes: list[str] = []
    if family is not None and family.query_scaled:
        notes.append("MaxText trains this family's query kernel pre-scaled by 1/sqrt(head_dim): the loss continues, "
                     "but Adam's step on that kernel is sqrt(head_dim) times DeepSpeed's")
    if model_config is not None and model_config.get("tie_word_embeddings"):
        notes.append("MaxText computes tied logits from the embedding table cast to bf16 (also in fp32 runs): "
                     "its gradients carry that rounding")
    if not saved or not saved.get("param_groups"):
        return {}, notes + ["the checkpoint records no optimizer settings: give MaxText the run's learning_rate, "
                            "adam_b1, adam_b2, adam_eps and adam_weight_decay (its defaults differ: b2 0.95, weight "
                            "decay 0.1)"]
    groups: list[Mapping[str, Any]] = list(saved["param_groups"])
    first = groups[0]
    differing = [key for key in ("lr", "betas", "eps", "weight_decay") if any(g.get(key) != first.get(key)
                                                                              for g in groups)]
    if differing:
        notes.append(f"the {len(groups)} param groups differ in {', '.join(differing)}: MaxText's adamw takes one "
                     "value for every parameter (the first group's are given)")
    if first.get("amsgrad"):
        notes.append("the run used AMSGrad, which MaxText's adamw does not have: the steps will differ")
    weight_decay = float(first.get("weight_decay") or 0.0)
    decoupled = first.get("decoupled_weight_decay")
    if decoupled is None:  # DeepSpeed's fused/CPU Adam: its config says (type AdamW, or Adam's adam_w_mode)
        optimizer = saved.get("optimizer") or {}
        kind = str(optimizer.get("type", "")).lower()
        decoupled = (kind == "adamw" or bool((optimizer.get("params") or {}).get("adam_w_mode", True))
                     if kind in ("adam", "adamw") else None)
    if weight_decay and decoupled is False:
        notes.append(f"the run's weight decay {weight_decay} is Adam's L2 term (added to the gradient); MaxText's "
                     "adamw decouples it, so the steps will differ")
    elif weight_decay and decoupled is None:
        notes.append(f"weight decay {weight_decay}: the checkpoint does not say whether it was decoupled (AdamW, "
                     "as MaxText's adamw) or Adam's L2 term")
    scheduler = saved.get("scheduler")
    if isinstance(scheduler, Mapping):
        notes.append(f"DeepSpeed's {scheduler.get('type', 'learning-rate')} scheduler: learning_rate is the rate at "
                     f"step {global_step}; give MaxText the same schedule (warmup_steps_fraction, "
                     "learning_rate_schedule_steps, lr_schedule_type) so that its step count, carried, reads it")
    betas = tuple(first.get("betas") or (0.9, 0.999))
    settings = adamw_settings(float(first.get("lr", 0.0)), (float(betas[0]), float(betas[1])),
                              float(first.get("eps", 1e-8)), weight_decay,
                              gradient_clipping=float(saved.get("gradient_clipping") or 0.0))
    # The precision the run computed in: MaxText computes in bf16 unless told (its weights stay fp32 either way,
    # as DeepSpeed's masters do).
    dtype = saved.get("dtype")
    if dtype in MAXTEXT_DTYPES:
        settings["dtype"] = MAXTEXT_DTYPES[dtype]
    elif dtype == "fp16":
        notes.append("the run computed in fp16 with loss scaling, which MaxText does not do: dtype=bfloat16 (its "
                     "default) or dtype=float32 changes the steps")
    accumulation = int(saved.get("gradient_accumulation_steps") or 1)
    if accumulation > 1:
        settings["gradient_accumulation_steps"] = accumulation
    micro = saved.get("train_micro_batch_size_per_gpu")
    if micro:
        notes.append(f"global batch {int(micro) * accumulation * dp_degree} sequences a step (per_device_batch_size "
                     "x MaxText's devices), in DeepSpeed's order; inputs = tokens[:, :-1], targets = tokens[:, 1:] "
                     "for transformers' labels=tokens (docs/maxtext.md, \"Continue a run in MaxText\")")
    return settings, notes
