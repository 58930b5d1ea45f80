"""LoRA under AutoTP at its edges, in one torchrun at TP=2 (``DS_ACCELERATOR=cpu``): a peft model with a second,
frozen adapter that has dropout (as ``PeftModel.from_pretrained`` leaves one) initializes; the model goes through
``deepspeed_ext.initialize`` twice (as a Trainer that builds a second engine does) and trains in both, its adapters
cut once; a forward mixing adapters in one batch (``adapter_names=``) is refused. Rank 0 writes what it saw as
JSON to the path given.

    torchrun --nproc_per_node 2 lora_autotp_edges.py RESULT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, build_model, finish_distributed
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(5)
    model = get_peft_model(build_model("llama"), LoraConfig(r=4, target_modules="all-linear"))
    model.add_adapter("frozen", LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.1))
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["frozen"].weight.requires_grad_(False)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".frozen." in n)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2},
              "deepspeed_ext": {"universal_checkpoint": {"enabled": True}}}
    seen: dict[str, object] = {}
    ids = batch(0, 0, 1)
    for engine_number in (1, 2):
        engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                             if p.requires_grad], config=config)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        seen[f"loss_{engine_number}"] = float(loss)
        seen[f"lora_B_rows_{engine_number}"] = int(
            model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.shape[0])
    model.eval()  # peft takes adapter_names= in eval mode only
    try:
        with torch.no_grad():
            model(input_ids=ids, adapter_names=["default", "frozen"] * (len(ids) // 2))
        seen["mixed_batch"] = "ran"
    except Exception as exc:  # noqa: BLE001 (what was raised is what the test reads)
        seen["mixed_batch"] = f"{type(exc).__name__}: {exc}"
    if int(os.environ.get("RANK", "0")) == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(seen, handle)
    finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
