"""A training script as a user writes it; run under ``torchrun``. Used by the demo, the benchmarks and (with
``Hooks`` for their probes) the tests.

Only ``deepspeed_ext.initialize`` differs from a plain DeepSpeed script (``--plain`` uses
``deepspeed.initialize`` and drops the ``deepspeed_ext`` section, to produce checkpoints without it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="llama")
    p.add_argument("--model-config", help="build the model from this HF config.json instead of the family's tiny "
                   "one (the family still picks the tensor_parallel section)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads of the family's tiny model (2 gives TP=3 and TP=4 "
                   "ranks with empty attention shards)")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--ep", type=int, default=0, help="DeepSpeed AutoEP's expert-parallel degree for an MoE family "
                   "(0: AutoEP off)")
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--grad-accum-dtype", choices=["fp32", "bf16", "fp16"],
                   help="DeepSpeed data_types.grad_accum_dtype (bf16 + ZeRO-1 + fp32 selects BF16_Optimizer)")
    p.add_argument("--optimizer", default="adam", help="adam, muon, adagrad (DeepSpeed's, by config) or sgd (a "
                   "client torch.optim.SGD with momentum)")
    p.add_argument("--fused-adam", action="store_true",
                   help="DeepSpeed's FusedAdam instead of torch's Adam (without ZeRO, bf16 then uses the flat "
                   "FP16_Optimizer instead of FP16_UnfusedOptimizer)")
    p.add_argument("--steps", type=int, default=5, help="train until this global step")
    p.add_argument("--warmup-steps", type=int, default=0, help="DeepSpeed's WarmupLR, linear from 0 over this many "
                   "steps (0: a constant learning rate)")
    p.add_argument("--save-dir")
    p.add_argument("--save-at", type=int, action="append", default=[],
                   help="save_checkpoint after this global step (repeat it to save several times; 0 saves before "
                   "the first step, with a fresh optimizer)")
    p.add_argument("--load-dir", help="resume from this checkpoint: universal, or a regular DeepSpeed one saved at "
                   "other TP/DP degrees (read directly, resharded at load time)")
    p.add_argument("--load-tag", help="the tag to load from --load-dir (default: the one its 'latest' names)")
    p.add_argument("--load-universal", action=argparse.BooleanOptionalAction, default=True,
                   help="set checkpoint.load_universal in the DeepSpeed config when --load-dir is given")
    p.add_argument("--restore", default="deepspeed_ext", choices=["deepspeed_ext", "deepspeed"],
                   help="who restores a universal checkpoint: deepspeed-ext, or DeepSpeed's own loader")
    p.add_argument("--fingerprints", default="error", choices=["error", "warn", "off"],
                   help="what a resume whose state disagrees with the saved fingerprints does")
    p.add_argument("--timing", help="write this rank's load and first-step wall time and bytes read (JSON) to "
                   "TIMING.rank<R>.json")
    p.add_argument("--plain", action="store_true",
                   help="deepspeed.initialize without our config section (saves only upstream's tags; "
                   "--load-dir then restores through upstream DeepSpeed)")
    p.add_argument("--async-save", nargs="?", const=True, default=False, choices=[True, "fork", "copy"],
                   help="save in the background (\"async_save\": true, or {\"snapshot\": fork|copy}); the run waits "
                   "for its last save at the end")
    p.add_argument("--node-local-storage", action="store_true",
                   help="DeepSpeed's checkpoint.use_node_local_storage: each node saves into and loads from its own "
                   "--save-dir / --load-dir (a disk the other nodes do not see); each node's first rank commits")
    p.add_argument("--freeze", help="freeze the parameters whose names match this regular expression "
                   "(requires_grad=False: trained by no optimizer, as a LoRA model's base or a frozen embedding)")
    p.add_argument("--lora", type=int, default=0, help="train peft LoRA adapters of this rank instead of the whole "
                   "model (0: off); the base weights are frozen")
    p.add_argument("--lora-alpha", type=float, help="the adapters' lora_alpha (default: twice the rank)")
    p.add_argument("--lora-targets", default="all-linear", help="the modules adapted: peft's target_modules, "
                   "comma-separated names or 'all-linear'")
    p.add_argument("--lora-options", default="{}", help="more LoraConfig settings, as JSON (e.g. "
                   "'{\"use_dora\": true}', '{\"modules_to_save\": [\"lm_head\"]}')")
    p.add_argument("--init-seed", type=int, default=1234, help="the seed the model's initial weights are drawn with "
                   "(a resume from another one relies on the checkpoint for every weight)")
    p.add_argument("--gradient-clipping", default="1.0", help="DeepSpeed's gradient_clipping (\"unset\": left out of "
                   "the config, so DeepSpeed's default applies)")
    p.add_argument("--progress", action="store_true", help="print each step's loss as it is trained (rank 0)")
    p.add_argument("--result", help="write losses (JSON) here")
    return p.parse_args(argv)


def _bytes_read() -> int:
    """Bytes this process has made the kernel fetch from storage (page-cache misses, mmap faults included)."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return -1


@dataclass
class Hooks:
    """Where a script built on this one looks at the engine (the tests' probes: state dumps, loss scales)."""

    #: ``(engine, tp_rank)`` right after ``load_checkpoint``.
    after_load: Callable[[Any, int], None] | None = None
    #: ``(engine, tp_rank)`` just before ``save_checkpoint``.
    before_save: Callable[[Any, int], None] | None = None
    #: ``(engine, step)`` right after ``save_checkpoint`` returned.
    after_save: Callable[[Any, int], None] | None = None
    #: ``(engine, step)`` after each global step; what it returns is kept per step under ``result_key``.
    after_step: Callable[[Any, int], Any] | None = None
    result_key: str = "after_step"


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> None:
    """One run (``run``), then the end of this torchrun worker."""
    from deepspeed_ext.demo.models import finish_distributed
    run(argv, hooks)
    finish_distributed()


def run(argv: list[str] | None = None, hooks: Hooks | None = None) -> None:
    """Build the model and the engine, resume if asked, train to ``--steps``, saving where asked. The process group
    stays up: a caller may start another run in this process (a fresh model and engine)."""
    args = parse_args(argv)
    hooks = hooks or Hooks()
    import deepspeed
    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, build_model, client_optimizer, ds_config, tiny_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {args.tp}")
    config = tiny_config(args.family, args.kv_heads)
    if args.model_config:
        from transformers import AutoConfig
        values = json.loads(Path(args.model_config).read_text())
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = build_model(args.family, seed=args.init_seed, config=config)
    if args.lora:
        model = with_lora(model, args)
    if args.freeze:
        import re
        for name, param in model.named_parameters():
            if re.search(args.freeze, name):
                param.requires_grad_(False)
    config = ds_config(tp=args.tp,
                       dp=world // args.tp,
                       zero=args.zero,
                       dtype=args.dtype,
                       grad_accum=args.grad_accum,
                       family=args.family,
                       ext=not args.plain,
                       load_universal=args.load_dir is not None and args.load_universal,
                       grad_accum_dtype=args.grad_accum_dtype,
                       fused_adam=args.fused_adam,
                       kv_heads=args.kv_heads,
                       restore=args.restore,
                       fingerprints=args.fingerprints,
                       ep=args.ep,
                       optimizer=args.optimizer,
                       warmup_steps=args.warmup_steps,
                       async_save=args.async_save,
                       gradient_clipping=None if args.gradient_clipping == "unset" else float(args.gradient_clipping))
    if args.node_local_storage:
        config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    init = deepspeed.initialize if args.plain else deepspeed_ext.initialize
    # Every parameter, frozen ones too, as DeepSpeed's examples hand them over: ZeRO leaves the frozen ones out of
    # its partitions; a stage-0 wrapper keeps an fp32 master of each, which it copies back at every step.
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=config,
                           optimizer=client_optimizer(args.optimizer, model.parameters()))

    from deepspeed_ext.checkpoint.engine_private import tp_group_info
    tp_size, tp_rank = tp_group_info()
    dp_size, dp_rank = world // tp_size, dist.get_rank() // tp_size  # TP groups are consecutive ranks
    timing: dict[str, float] = {"rank": dist.get_rank(), "tp": tp_size, "dp": dp_size}
    if args.load_dir:
        rss_before = _reset_peak_rss() if args.timing else 0
        state_before = _optimizer_state_bytes(engine)
        io_before, start = _bytes_read(), time.perf_counter()
        engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        timing["load_s"] = time.perf_counter() - start
        timing["load_read_bytes"] = _bytes_read() - io_before
        # What the restore held above the engine it restored into: its peak RSS over the RSS it started at, less
        # the Adam buffers it created (a fresh engine has none before its first step, which would create them).
        timing["load_peak_rss_gain_bytes"] = _status_kib("VmHWM") * 1024 - rss_before
        timing["load_new_optimizer_state_bytes"] = _optimizer_state_bytes(engine) - state_before
        timing["share_bytes"] = _share_bytes(engine)
        if hooks.after_load:
            hooks.after_load(engine, tp_rank)

    losses, probed = {}, {}
    if args.save_dir and 0 in args.save_at and engine.global_steps == 0:  # before any optimizer step
        if hooks.before_save:
            hooks.before_save(engine, tp_rank)
        engine.save_checkpoint(args.save_dir)
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        value = torch.zeros((), device=engine.device)  # on the engine's device: NCCL reduces device tensors
        for micro in range(args.grad_accum):
            tokens = batch(step, dp_rank, dp_size, micro, args.grad_accum).to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            value += loss.detach().float()
        dist.all_reduce(value)  # mean over micro-batches and DP (TP ranks hold the same loss)
        losses[step] = value.item() / dist.get_world_size() / args.grad_accum
        if args.progress and dist.get_rank() == 0:
            from deepspeed_ext.demo.runner import PROGRESS
            print(f"{PROGRESS}step {step}/{args.steps}: loss {losses[step]:.4f}", flush=True)
        if hooks.after_step:
            probed[step] = hooks.after_step(engine, step)
        if "first_step_s" not in timing and args.load_dir:
            timing["first_step_s"] = time.perf_counter() - start
        if args.save_dir and step in args.save_at:
            if hooks.before_save:
                hooks.before_save(engine, tp_rank)
            engine.save_checkpoint(args.save_dir)
            if hooks.after_save:
                hooks.after_save(engine, step)
    if args.async_save:
        deepspeed_ext.wait_for_saves(engine)
    if args.timing:
        Path(f"{args.timing}.rank{dist.get_rank()}.json").write_text(json.dumps(timing))
    if args.result and dist.get_rank() == 0:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps({"tp": args.tp, "losses": losses,
                                                **({hooks.result_key: probed} if hooks.after_step else {})}))


def with_lora(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters as ``--lora*`` ask (its base weights frozen)."""
    from peft import LoraConfig, get_peft_model
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    options = {"lora_dropout": 0.0, **json.loads(args.lora_options)}
    config = LoraConfig(r=args.lora, lora_alpha=args.lora_alpha or 2 * args.lora, target_modules=targets,
                        task_type="CAUSAL_LM", **options)
    # The adapters' own initial values from the same seed on every rank (peft draws lora_A at random).
    torch.manual_seed(args.init_seed + 1)
    return get_peft_model(model, config)


def _optimizer_state_bytes(engine: Any) -> int:
    """Bytes of the tensors in the (wrapped) torch optimizer's state."""
    from deepspeed_ext.checkpoint import engine_private
    optimizer = engine_private.base_optimizer(engine)
    storages = {value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
                for state in getattr(optimizer, "state", {}).values() for value in state.values()
                if torch.is_tensor(value)}
    return sum(storages.values())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs); the RSS, bytes."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_kib("VmRSS") * 1024


def _share_bytes(engine: Any) -> int:
    """This rank's share of the fp32 masters and both Adam moments: under ZeRO-3 its partition of its TP slice,
    else its TP slice (what ZeRO-1/2 at DP=1 load)."""
    from deepspeed_ext.checkpoint import engine_private
    elements = 0
    for param in engine.module.parameters():
        if engine_private.is_zero3_param(param):
            start, stop, _ = engine_private.zero3_partition(param)
            elements += stop - start
        else:
            elements += param.numel()
    return elements * 4 * 3


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
