"""A receiver of weight updates (``deepspeed_ext.receive_weights``) into a transformers model of the demo's
family, which after each update writes the logits of the demo's evaluation batch.

    --group HOST:PORT --senders N --family F --kv-heads K --dtype bf16 --updates U --out DIR
    [--receiver I] [--receivers R] [--peft-lora R]

``--peft-lora R``: the receiver is the trainer's peft model (the demo's base, LoRA adapters of rank R on every
linear layer), which takes updates of the adapters alone; after each it writes its adapters' tensors (live names) to
DIR/adapters_v<version>.pt instead of logits.

DIR/logits_v<version>.pt for each update; an update refused: its one line in DIR/refused.txt, and the receiver
goes on to the next (``--updates`` counts both).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--senders", type=int, required=True)
    parser.add_argument("--receiver", type=int, default=0)
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--atomic", action="store_true")
    parser.add_argument("--peft-lora", type=int, default=0)
    args = parser.parse_args()

    import deepspeed_ext
    from transformers import AutoModelForCausalLM

    from deepspeed_ext.demo.models import eval_batch, tiny_config
    from deepspeed_ext.errors import CheckpointError
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # As from_pretrained builds it for the dtype (the rotary frequencies stay fp32), with random weights that the
    # first update replaces.
    model = AutoModelForCausalLM.from_config(tiny_config(args.family, args.kv_heads), dtype=dtype,
                                             attn_implementation="eager").eval()
    if args.peft_lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.peft_lora, lora_alpha=2 * args.peft_lora, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    host, port = args.group.rsplit(":", 1)
    group = deepspeed_ext.weight_group(host, int(port), senders=args.senders, receivers=args.receivers,
                                       receiver=args.receiver, timeout=120)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(args.updates):
        try:
            version = deepspeed_ext.receive_weights(group, model, atomic=args.atomic)
        except CheckpointError as exc:
            with open(out / "refused.txt", "a") as handle:
                handle.write(f"{exc}\n")
            if group.broken is not None:
                break
            continue
        if args.peft_lora:
            torch.save({name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name},
                       out / f"adapters_v{version}.pt")
            continue
        with torch.no_grad():
            torch.save(model(input_ids=eval_batch()).logits, out / f"logits_v{version}.pt")


if __name__ == "__main__":
    main()
