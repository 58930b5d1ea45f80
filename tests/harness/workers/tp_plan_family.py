"""A transformers model type outside deepspeed-ext's family registry, trained 3 steps (fp32, ZeRO-1) with AutoTP at
``TP`` through ``deepspeed_ext.tensor_parallel_preset(MODEL_TYPE)`` (its tp_plan translated), on a tiny config of
the type's own shapes (its defaults, shrunk). Rank 0 writes the losses and the parameters AutoTP split as JSON.

    torchrun --nproc_per_node TP tp_plan_family.py MODEL_TYPE TP RESULT.json
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

#: The sizes every tiny config takes where the type has the setting (MoE: 4 experts, top-2, one shared, one dense
#: layer first); the rest stays the type's own default.
SMALL = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts=4,
             num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
             max_position_embeddings=64, sliding_window=8, n_group=1, topk_group=1, tie_word_embeddings=False)


def tiny_config(model_type: str):  # noqa: ANN201 (a transformers config)
    from transformers import AutoConfig
    config = AutoConfig.for_model(model_type)
    for key, value in SMALL.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:SMALL["num_hidden_layers"]])
    return config


def main() -> None:
    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, finish_distributed
    from transformers import AutoModelForCausalLM
    model_type, tp, result = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager").float()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "tensor_parallel": {"autotp_size": tp, **deepspeed_ext.tensor_parallel_preset(model_type)},
              "deepspeed_ext": {"universal_checkpoint": {"enabled": True}}}
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(3):
        ids = batch(step, 0, 1)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    if int(os.environ.get("RANK", "0")) == 0:
        split = sorted({re.sub(r"\.\d+\.", ".*.", name) for name, param in engine.module.named_parameters()
                        if not getattr(param, "ds_ext_tp_layout").is_replicated})
        with open(result, "w") as handle:
            json.dump({"losses": losses, "split": split}, handle)
    finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
