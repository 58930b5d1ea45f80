"""Tiny transformer configs built in code (never downloaded), used by the demo and the tests.

Every family's tiny config is here, once, in two sizes. The training sizes exercise the hard cases of tensor
parallelism: GQA (16 query / 4 KV heads), a vocabulary (101) and an MLP width (160) that do not divide by 3, so
TP=3 and TP=4 cut uneven shards. The MaxText sizes are what the tests run MaxText's own model code on.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from deepspeed_ext.demo.recent_families import MAXTEXT_VARIANTS

#: A family trained with AutoTP only (explicit partition specs, see :func:`tensor_parallel_section`): no MaxText
#: mapping, so it is not in the family registry.
AUTOTP_ONLY = ("phi3", )
#: Test variants of a family (a config of its own, the family's mapping): deepseek-v3 with DeepSeek-V3's own yarn
#: RoPE, whose MaxText settings differ from the plain RoPE model's; Kimi-K2, which loads as deepseek_v3 with its own
#: config (one expert group, one dense layer, yarn RoPE with Kimi's betas and theta, its routed scaling).
#: Gemma 4 as the E2B (per-layer inputs, shared KV) and the 26B (MoE) are, beside its 31B-like MaxText config.
VARIANTS = {"deepseek-v3-yarn": "deepseek-v3", "kimi-k2": "deepseek-v3", **MAXTEXT_VARIANTS}


def tiny_families() -> tuple[str, ...]:
    """Every family a tiny config is built for: the registry's (:mod:`deepspeed_ext.checkpoint.families`, in its
    spelling), then the AutoTP-only ones. Tests take their family lists from here, so a new family is tested
    without a test listing it."""
    from deepspeed_ext.checkpoint.families import family_names
    return (*family_names(), *AUTOTP_ONLY)


FAMILIES = tiny_families()


def tiny_config(family: str = "llama", kv_heads: int = 4, *, maxtext_head_dim: int | None = None) -> Any:
    """The tiny config of ``family`` (the registry's spelling, ``qwen3-moe``; the HF one, ``qwen3_moe``, works
    too), of a name in :data:`VARIANTS`, or of ``phi3``.

    Training sizes by default. ``kv_heads``: fewer KV heads than TP ranks is legal in DeepSpeed (the ranks beyond
    the head count hold empty attention shards), a geometry the tests train with 2.

    ``maxtext_head_dim``: the MaxText sizes instead: heads of that size (64 / it query heads, 32 / it KV heads),
    vocabulary 256, MLP 128, and the family's RoPE and norm constants as the MaxText tests set them (head_dim 8
    makes the 1/sqrt(head_dim) query scaling of some families round, which the round-trip tests need).
    """
    family = family.replace("_", "-")
    from deepspeed_ext.demo.recent_families import SETTINGS, recent_tiny_config
    if family in SETTINGS or family in MAXTEXT_VARIANTS:  # 2025-26's: their own head counts, MaxText sizes if mapped
        return recent_tiny_config(family, maxtext_head_dim)
    maxtext = maxtext_head_dim is not None
    head_dim = maxtext_head_dim or 4  # training: 64 / 16 heads
    if maxtext:
        common: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=64 // head_dim, num_key_value_heads=32 // head_dim,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    else:
        common = dict(vocab_size=101, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=False)
    head = {"head_dim": head_dim}
    maxtext_head = head if maxtext else {}  # training: only the families whose config needs it spelled out

    def eps(value: float) -> dict[str, float]:
        """MaxText sizes: the family's RMSNorm epsilon as the MaxText tests set it (training: transformers')."""
        return {"rms_norm_eps": value} if maxtext else {}

    moe_width = 32 if maxtext else 48
    extra: dict[str, Any] = {}  # a family's settings beyond the sizes
    if family in ("llama", "llama3.1"):
        from transformers import LlamaConfig
        if family == "llama3.1":  # Llama with Llama 3.1's RoPE scaling (MaxText's llama3.1 constants)
            extra["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0 if maxtext else 500000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}
        elif maxtext:
            extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        if maxtext:
            extra["max_position_embeddings"] = 16384
        return LlamaConfig(**{**common, **extra}, **maxtext_head, **eps(1e-5))
    if family == "mistral":
        from transformers import MistralConfig
        extra = {"rope_theta": 10000.0} if maxtext else {}
        return MistralConfig(**common, **maxtext_head, **extra, **eps(1e-5), sliding_window=None)
    if family == "phi3":  # fused qkv_proj (q, k, v of unequal size) and fused gate_up_proj
        from transformers import Phi3Config
        return Phi3Config(**common, **maxtext_head, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen2":  # q/k/v projections with biases (column-split with their weights); no head_dim setting
        from transformers import Qwen2Config
        extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}} if maxtext else {}
        return Qwen2Config(**common, **extra, **eps(1e-6))
    if family == "qwen3":  # q/k norms and tied embeddings: AutoTP makes embedding + lm_head vocab-parallel
        from transformers import Qwen3Config
        return Qwen3Config(**{**common, "tie_word_embeddings": True}, **head, **eps(1e-6))
    if family == "qwen3-moe":  # 4 experts, top-2 routing; transformers stores each layer's experts fused (3-D)
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**common, **head, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=moe_width, decoder_sparse_step=1, norm_topk_prob=True,
                              **eps(1e-6))
    if family == "mixtral":  # 4 experts, top-2; its router and fused experts stay whole under AutoTP
        from transformers import MixtralConfig
        return MixtralConfig(**common, **maxtext_head, num_local_experts=4, num_experts_per_tok=2, **eps(1e-5))
    if family == "gemma3":  # 7 layers: five sliding-window layers, one global, one past the cycle; tied
        from transformers import Gemma3TextConfig
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 7, "tie_word_embeddings": True}, **head,
                                query_pre_attn_scalar=head_dim, sliding_window=8)
    if family == "gpt-oss":  # attention sinks, biases, interleaved gate/up experts, sliding/global layers
        from transformers import GptOssConfig
        return GptOssConfig(**{**common, "max_position_embeddings": 131072}, **head, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8)
    # deepseek-v3: MLA, one dense layer then two MoE layers (8 experts in 2 groups, top-1 group, 1 shared expert)
    if family in ("deepseek-v3", "deepseek-v3-yarn", "kimi-k2"):
        from transformers import DeepseekV3Config
        if maxtext:
            extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        if family == "deepseek-v3-yarn":  # DeepSeek-V3's own RoPE: yarn, 40x context, attention rescaled
            extra["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                        "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
            extra["max_position_embeddings"] = 163840
        group: dict[str, Any] = dict(n_group=2, topk_group=1)  # 8 experts in 2 groups, top-1 group
        if family == "kimi-k2":  # Kimi-K2's config.json, shrunk: theta 50000, yarn x32 with betas 1/1, no groups
            extra["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                        "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
            extra["max_position_embeddings"] = 131072
            group = dict(n_group=1, topk_group=1, routed_scaling_factor=2.827)
        # MLA has one key per head: transformers requires num_key_value_heads == num_attention_heads.
        return DeepseekV3Config(**{**common, "num_hidden_layers": 3,
                                   "num_key_value_heads": common["num_attention_heads"], **extra},
                                first_k_dense_replace=1, moe_intermediate_size=moe_width, n_routed_experts=8,
                                n_shared_experts=1, num_experts_per_tok=2, **group, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8 if maxtext else 4, qk_nope_head_dim=head_dim,
                                v_head_dim=head_dim, **eps(1e-6))
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join((*FAMILIES, *VARIANTS))}")


def build_model(family: str = "llama", seed: int = 1234, config: Any = None) -> torch.nn.Module:
    """The same initial weights on every rank (AutoTP cuts its slices from this full model).

    ``config`` (a transformers config) replaces the family's tiny one, e.g. for the benchmarks' 246M Llama.
    """
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model: torch.nn.Module = AutoModelForCausalLM.from_config(config or tiny_config(family), attn_implementation="eager")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # DeepSeek's router bias starts at zero and is tuned outside the optimizer; a pretrained model has
                # it set, so give it values that steer the expert choice, as a real checkpoint's do.
                buffer.copy_(0.1 * torch.randn(buffer.shape))
            elif name.endswith("tid2eid"):
                # DeepSeek-V4's hash routing table (token id -> its experts) starts at zero, every token on expert
                # 0 twice; a release ships a table of distinct experts per token, so give it one.
                vocab, top_k = buffer.shape
                experts = getattr(model.config, "n_routed_experts", top_k)
                buffer.copy_(torch.rand(vocab, experts).argsort(dim=-1)[:, :top_k])
    return model


def tensor_parallel_section(family: str, tp: int, kv_heads: int = 4) -> dict[str, Any]:
    """The ``tensor_parallel`` config section for ``family``.

    Phi3 needs explicit specs: DeepSpeed's phi3 preset assumes q, k and v of equal size, which is wrong with
    GQA. Every other family takes the preset deepspeed-ext ships for it (``tensor_parallel_preset``; none where
    AutoTP's defaults work).
    """
    section: dict[str, Any] = {"autotp_size": tp}
    if family == "phi3":
        cfg = tiny_config("phi3", kv_heads)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        section["partition_config"] = {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.self_attn\.qkv_proj\.weight$"], "partition_type": "column",
                 "shape": [[q, kv, kv], -1], "partition_dim": 0},
                {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column",
                 "shape": [2, -1], "partition_dim": 0},
                {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r"^lm_head\.weight$"], "partition_type": "column"},
            ],
        }
    else:  # the preset deepspeed-ext ships for the family ({} where AutoTP's defaults work)
        from deepspeed_ext.presets import tensor_parallel_preset
        section.update(tensor_parallel_preset(family))
    return section


#: Sequences per optimizer step, split over DP ranks, so runs at any DP degree see the same data.
GLOBAL_BATCH = 4
SEQ_LEN = 16


def ds_config(*,
              tp: int,
              dp: int = 1,
              zero: int = 1,
              dtype: str = "bf16",
              grad_accum: int = 1,
              family: str = "llama",
              ext: bool = True,
              load_universal: bool = False,
              grad_accum_dtype: str | None = None,
              fused_adam: bool = False,
              lr: float = 1e-2,
              kv_heads: int = 4,
              restore: str = "deepspeed_ext",
              fingerprints: str = "error",
              ep: int = 0,
              optimizer: str = "adam",
              warmup_steps: int = 0,
              async_save: bool | str = False,
              gradient_clipping: float | None = 1.0) -> dict[str, Any]:
    """A DeepSpeed config as a user has it, plus the one ``deepspeed_ext`` section (``restore`` and
    ``fingerprints``: its settings, see :mod:`deepspeed_ext.config`). ``ep``: train an MoE family with DeepSpeed
    AutoEP at that expert-parallel degree (0: AutoEP off). ``optimizer``: one of :data:`OPTIMIZERS`.
    ``warmup_steps``: DeepSpeed's WarmupLR, linear from 0 to ``lr`` over that many steps (0: a constant rate).
    ``async_save``: saves written in the background (the section's ``async_save``; "fork" or "copy": that
    snapshot). ``gradient_clipping``: None
    leaves it out of the config (DeepSpeed then applies its own default)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (dp * grad_accum),
        "gradient_accumulation_steps": grad_accum,
        **optimizer_section(optimizer, lr, fused_adam),
        "zero_optimization": {"stage": zero},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 12, "loss_scale_window": 2},
        **({"gradient_clipping": gradient_clipping} if gradient_clipping is not None else {}),
        "steps_per_print": 1000,
        "tensor_parallel": tensor_parallel_section(family, tp, kv_heads),
    }
    if optimizer == "muon" and zero == 3:
        config["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon refuses it under ZeRO-3
    if ep:
        from deepspeed_ext.presets import expert_parallel_preset
        # Grouped GEMM kernels are for accelerators; on the CPU AutoEP runs each expert's matmuls.
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "use_grouped_mm": False,
                                     **expert_parallel_preset(family)}
        if tp == 1:
            del config["tensor_parallel"]  # AutoEP alone: no AutoTP preset for the dense layers to apply
    if ext:
        config["deepspeed_ext"] = {"universal_checkpoint": {"enabled": True, "restore": restore,
                                                            "fingerprints": fingerprints}}
        if async_save:
            config["deepspeed_ext"]["async_save"] = \
                {"snapshot": async_save} if isinstance(async_save, str) else True
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    if warmup_steps:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                              "warmup_num_steps": warmup_steps,
                                                              "warmup_type": "linear"}}
    if grad_accum_dtype is not None:
        # bf16 + ZeRO-1 + fp32 gradient accumulation selects DeepSpeed's BF16_Optimizer.
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


#: The optimizers the demo trains with: DeepSpeed's own by config (``adam``, ``muon``, ``adagrad``), or a client
#: ``torch.optim`` optimizer the script builds (``sgd``: SGD with momentum).
OPTIMIZERS = ("adam", "muon", "adagrad", "sgd")


def optimizer_section(optimizer: str, lr: float, fused_adam: bool = False) -> dict[str, Any]:
    """The DeepSpeed config's optimizer entries for the demo's ``optimizer``; a client optimizer
    (:func:`client_optimizer`) has none, and needs ``zero_allow_untested_optimizer`` under ZeRO."""
    if optimizer == "adam":
        return {"optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": not fused_adam}}}
    if optimizer == "muon":  # Muon for the matrices, its auxiliary Adam for embeddings, norms and the head
        return {"optimizer": {"type": "Muon", "params": {"lr": lr, "momentum": 0.9, "weight_decay": 0.01}}}
    if optimizer == "adagrad":
        return {"optimizer": {"type": "Adagrad", "params": {"lr": lr}}}
    if optimizer in OPTIMIZERS:
        return {"zero_allow_untested_optimizer": True}
    raise ValueError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")


def client_optimizer(optimizer: str, parameters: Any, lr: float = 1e-2) -> torch.optim.Optimizer | None:
    """The optimizer the script builds itself and hands ``deepspeed.initialize`` (None: DeepSpeed builds it)."""
    if optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    return None


def batch(step: int, dp_rank: int, dp_size: int, micro: int = 0, grad_accum: int = 1, vocab: int = 101) -> torch.Tensor:
    """Micro-batch ``micro`` of this DP rank's share of ``step``'s global batch (same on every TP rank)."""
    if GLOBAL_BATCH % (dp_size * grad_accum):
        raise ValueError(f"DP {dp_size} x grad accumulation {grad_accum} does not divide the global batch of "
                         f"{GLOBAL_BATCH}")
    # Arithmetic progressions mod vocab: learnable in a few steps, so the loss curve visibly moves
    # and a resume that lost state would stand out.
    generator = torch.Generator().manual_seed(100_003 * step)
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=generator)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ_LEN)) % vocab
    rows = GLOBAL_BATCH // (dp_size * grad_accum)
    first = (dp_rank * grad_accum + micro) * rows
    return tokens[first:first + rows]


def eval_batch() -> torch.Tensor:
    """A fixed batch no training step sees, for comparing a model's logits across formats."""
    return batch(10_000, 0, 1)


def finish_distributed() -> None:
    """End a torchrun worker whose work is complete and written.

    DeepSpeed's CPU backend sometimes aborts during interpreter teardown ("terminate called without an
    active exception", a joinable C++ thread destroyed at exit), turning a finished run into a failed
    one. So destroy the process group explicitly and leave without running static destructors.
    """
    import sys

    import torch.distributed as dist
    runtime = sys.modules.get("deepspeed_ext.runtime")
    if runtime is not None:
        runtime.finish_background_saves()  # what atexit would do: os._exit below skips it
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
