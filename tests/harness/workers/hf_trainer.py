"""A Hugging Face Trainer script as a user writes it, with deepspeed-ext enabled from the DeepSpeed config.

Run under torchrun (``DS_ACCELERATOR=cpu``) with TP x DP processes; each DP rank takes ``--batch / DP`` sequences,
so the global batch is ``--batch`` at every degree and runs at any TP and DP see the same data in the same order.
``--lora R``: the model is a peft LoRA model (adapters of rank R on every linear layer, the base frozen).

    torchrun --nproc_per_node 2 hf_trainer.py --tp 2 --zero 1 --steps 6 --save-steps 3 --output-dir OUT \
        --result losses.json [--resume OUT/checkpoint-3 | --resume latest] [--load-universal] [--no-ext] [--lora 4]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--dp", type=int, default=1, help="the data-parallel degree (torchrun starts TP x DP processes)")
    p.add_argument("--lora", type=int, default=0, help="train peft LoRA adapters of this rank (0: the whole model)")
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--family", default="llama")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", help="a checkpoint-N directory, or 'latest' (resume_from_checkpoint=True)")
    p.add_argument("--load-universal", action="store_true", help='"checkpoint": {"load_universal": true}')
    p.add_argument("--no-ext", action="store_true", help="without the deepspeed_ext section")
    p.add_argument("--async-save", nargs="?", const=True, default=False, choices=[True, "fork", "copy"],
                   help='"async_save": true in the deepspeed_ext section (or {"snapshot": fork|copy})')
    p.add_argument("--save-total-limit", type=int, help="the Trainer's save_total_limit (it rotates checkpoint-N)")
    p.add_argument("--fp32", action="store_true", help="train in fp32 (bf16=False) instead of bf16")
    p.add_argument("--dump-logits", help="after training, the model's logits on the demo's eval batch (rank 0 writes)")
    p.add_argument("--result", required=True)
    return p.parse_args()


class TokenSequences(torch.utils.data.Dataset):
    """Arithmetic progressions mod the vocabulary: learnable, so the loss curve moves."""

    def __init__(self, count: int = 64, length: int = 16, vocab: int = 101):
        generator = torch.Generator().manual_seed(7)
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        stride = torch.randint(1, 4, (count, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_tokenizer() -> object:
    """A word-level tokenizer over the model's 101 ids, built in code; the Trainer saves it with each checkpoint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<pad>": 1, **{f"t{i}": i for i in range(2, 101)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>")


def main() -> None:
    args = parse_args()
    import deepspeed_ext
    deepspeed_ext.enable()  # the one added line: every deepspeed.initialize honours the config's section

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from deepspeed_ext.demo.models import build_model, finish_distributed, tensor_parallel_section

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": args.zero},
        "tensor_parallel": tensor_parallel_section(args.family, args.tp),
        "steps_per_print": 1000,
    }
    if not args.no_ext:
        ds_config["deepspeed_ext"] = {"universal_checkpoint": {"enabled": True}, "async_save": (
            {"snapshot": args.async_save} if isinstance(args.async_save, str) else args.async_save)}
    if args.load_universal:
        ds_config["checkpoint"] = {"load_universal": True}
    training = TrainingArguments(output_dir=args.output_dir,
                                 per_device_train_batch_size=args.batch // args.dp,
                                 max_steps=args.steps,
                                 save_steps=args.save_steps,
                                 save_strategy="steps",
                                 save_total_limit=args.save_total_limit,
                                 learning_rate=1e-2,
                                 warmup_steps=2,
                                 lr_scheduler_type="linear",
                                 logging_steps=1,
                                 bf16=not args.fp32,
                                 use_cpu=True,
                                 deepspeed=ds_config,
                                 report_to=[],
                                 seed=1234,
                                 dataloader_num_workers=0,
                                 disable_tqdm=True)
    losses: dict[int, float] = {}
    learning_rates: dict[int, float] = {}
    #: At each save's return (after the Trainer's rotation): every checkpoint-N there, and those whose save is
    #: complete (committed), as the resume would pick them.
    after_saves: dict[int, dict[str, list[str]]] = {}

    class RecordLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN003
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])
                learning_rates[state.global_step] = float(logs["learning_rate"])

        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            from deepspeed_ext.checkpoint.locate import trainer_checkpoints
            folders = sorted(path.name for path in Path(args.output_dir).glob("checkpoint-*"))
            newest, skipped = trainer_checkpoints(Path(args.output_dir))
            complete = [name for name in folders if name not in {Path(path).name for path, _ in skipped}]
            after_saves[state.global_step] = {"folders": folders, "complete": complete,
                                              "newest_complete": None if newest is None else Path(newest).name}

    model = build_model(args.family)
    if args.lora:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(4321)  # peft draws lora_A at random: the same initial adapters on every rank and run
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear",
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainer = Trainer(model=model, args=training, train_dataset=TokenSequences(),
                      processing_class=tiny_tokenizer(), callbacks=[RecordLoss()])
    resume = True if args.resume == "latest" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    if args.dump_logits:  # every rank runs the forward (tensor parallelism's collectives); rank 0 keeps it
        from deepspeed_ext.demo.models import eval_batch
        trainer.model_wrapped.eval()
        with torch.no_grad():
            found = trainer.model_wrapped(input_ids=eval_batch()).logits.float()
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(found, args.dump_logits)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps({"tp": args.tp, "losses": losses, "learning_rates": learning_rates,
                                                 "global_step": trainer.state.global_step,
                                                 "after_saves": after_saves}))
    finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
