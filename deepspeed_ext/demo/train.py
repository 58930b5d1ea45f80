"""A training script as a user writes it; run under ``torchrun``. Used by the demo and the tests.

Only ``deepspeed_ext.initialize`` differs from a plain DeepSpeed script (``--plain`` uses
``deepspeed.initialize`` and drops the ``deepspeed_ext`` section, to produce checkpoints without it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="llama")
    p.add_argument("--model-config", help="build the model from this HF config.json instead of the family's tiny "
                   "one (the family still picks the tensor_parallel section)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads of the family's tiny model (2 gives TP=3 and TP=4 "
                   "ranks with empty attention shards)")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--grad-accum-dtype", choices=["fp32", "bf16", "fp16"],
                   help="DeepSpeed data_types.grad_accum_dtype (bf16 + ZeRO-1 + fp32 selects BF16_Optimizer)")
    p.add_argument("--fused-adam", action="store_true",
                   help="DeepSpeed's FusedAdam instead of torch's Adam (without ZeRO, bf16 then uses the flat "
                   "FP16_Optimizer instead of FP16_UnfusedOptimizer)")
    p.add_argument("--allow-cpu-fp16", action="store_true",
                   help="let DeepSpeed's CPU accelerator run fp16 although the CPU lacks native fp16 kernels")
    p.add_argument("--steps", type=int, default=5, help="train until this global step")
    p.add_argument("--save-dir")
    p.add_argument("--save-at", type=int, help="save_checkpoint after this global step")
    p.add_argument("--load-dir", help="resume from this checkpoint: universal, or a regular DeepSpeed one saved at "
                   "other TP/DP degrees (read directly, resharded at load time)")
    p.add_argument("--load-universal", action=argparse.BooleanOptionalAction, default=True,
                   help="set checkpoint.load_universal in the DeepSpeed config when --load-dir is given")
    p.add_argument("--dump-loaded", help="right after load_checkpoint, dump each TP rank's fp32/exp_avg/exp_avg_sq "
                   "here")
    p.add_argument("--timing", help="write this rank's load and first-step wall time and bytes read (JSON) to "
                   "TIMING.rank<R>.json")
    p.add_argument("--plain", action="store_true",
                   help="deepspeed.initialize without our config section (saves only upstream's tags; "
                   "--load-dir then restores through upstream DeepSpeed)")
    p.add_argument("--result", help="write losses (JSON) here")
    p.add_argument("--dump", help="at save time, dump each TP rank's fp32/exp_avg/exp_avg_sq here")
    return p.parse_args()


def _zero0_live_state(engine) -> dict:
    """Without ZeRO DeepSpeed has no fragment API: read its optimizer's own objects.

    bf16 with FusedAdam uses FP16_Optimizer (flat fp32 master per group, unflattened here with torch's
    own helper), bf16 with another Adam FP16_UnfusedOptimizer; fp32 steps the parameters directly.
    """
    from torch._utils import _unflatten_dense_tensors
    optimizer = engine.optimizer
    names = {param: name for name, param in engine.module.named_parameters()}
    state = {}
    if hasattr(optimizer, "fp32_groups_flat"):
        base = optimizer.optimizer
        for group, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat, strict=True):
            moments = base.state[flat]
            per_state = {"fp32": _unflatten_dense_tensors(flat, group),
                         "exp_avg": _unflatten_dense_tensors(moments["exp_avg"], group),
                         "exp_avg_sq": _unflatten_dense_tensors(moments["exp_avg_sq"], group)}
            for i, param in enumerate(group):
                state[names[param]] = {key: tensors[i].clone() for key, tensors in per_state.items()}
    else:
        # FP16_UnfusedOptimizer: an fp32 master per parameter; bare torch optimizer: the parameter itself.
        masters = {}
        if hasattr(optimizer, "fp32_groups"):
            for params, group_masters in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
                masters.update(zip(params, group_masters, strict=True))
        base = getattr(optimizer, "optimizer", optimizer)
        for name, param in engine.module.named_parameters():
            if param.numel() == 0:
                continue  # filled in by dump_live_state
            master = masters.get(param, param)
            moments = base.state[master]
            state[name] = {"fp32": master.detach().clone(), "exp_avg": moments["exp_avg"].clone(),
                           "exp_avg_sq": moments["exp_avg_sq"].clone()}
    return state


def dump_live_state(engine, path: Path, tp_rank: int) -> None:
    """The TP-local full fp32 master weights and Adam moments, gathered over DP by DeepSpeed itself."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if not engine.zero_optimization():
        state = _zero0_live_state(engine)
    else:
        state = {}
        for name, param in engine.module.named_parameters():
            if torch.Size(getattr(param, "ds_shape", param.shape)).numel() == 0:
                continue
            state[name] = {
                "fp32": safe_get_full_fp32_param(param).clone(),
                "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").clone(),
            }
    for name, param in engine.module.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if torch.Size(shape).numel() == 0:
            # A rank beyond the KV-head count holds no attention shard; DeepSpeed leaves such empty
            # parameters out of the optimizer, so they have no fp32 master or moments to ask for.
            state[name] = {key: torch.zeros(shape) for key in ("fp32", "exp_avg", "exp_avg_sq")}
    from deepspeed_ext.demo.models import eval_batch
    with torch.no_grad():  # every rank runs the forward: TP (and ZeRO-3) layers communicate
        logits = engine.module(input_ids=eval_batch()).logits.float()
    if engine.global_rank == tp_rank:  # DP rank 0 of each TP rank writes
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state, path / f"tp_rank_{tp_rank:02d}.pt")
        # Full logits, or this rank's vocab shard where the output projection is vocab-parallel.
        torch.save(logits, path / f"logits_tp_rank_{tp_rank:02d}.pt")


def _bytes_read() -> int:
    """Bytes this process has made the kernel fetch from storage (page-cache misses, mmap faults included)."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return -1


def allow_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator reports fp16 unsupported unless oneDNN has native fp16 kernels
    (AVX512-FP16/AMX-FP16). That is a speed gate: torch computes fp16 correctly on any CPU, only slower.
    Lifting it lets the real fp16 path (FP16 optimizers, dynamic loss scaler) run on such machines."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def loss_scale(engine) -> float | None:
    """The optimizer's current loss scale (fp16), or None without loss scaling."""
    optimizer = engine.optimizer
    scaler = getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)
    return float(scaler.cur_scale) if scaler is not None and hasattr(scaler, "cur_scale") else None


def main() -> None:
    args = parse_args()
    import deepspeed
    import torch.distributed as dist
    if args.allow_cpu_fp16:
        allow_cpu_fp16()

    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, build_model, ds_config, finish_distributed, tiny_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {args.tp}")
    config = tiny_config(args.family, args.kv_heads)
    if args.model_config:
        from transformers import AutoConfig
        values = json.loads(Path(args.model_config).read_text())
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = build_model(args.family, config=config)
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
                       kv_heads=args.kv_heads)
    init = deepspeed.initialize if args.plain else deepspeed_ext.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=config)

    from deepspeed_ext.module_inject.autotp import tp_group_info
    tp_size, tp_rank = tp_group_info()
    dp_size, dp_rank = world // tp_size, dist.get_rank() // tp_size  # TP groups are consecutive ranks
    timing = {"rank": dist.get_rank(), "tp": tp_size, "dp": dp_size}
    if args.load_dir:
        io_before, start = _bytes_read(), time.perf_counter()
        engine.load_checkpoint(args.load_dir)
        timing["load_s"] = time.perf_counter() - start
        timing["load_read_bytes"] = _bytes_read() - io_before
        # This rank's TP slice of the fp32 master and both Adam moments (ZeRO-1/2 at DP=1 load all of it).
        timing["share_bytes"] = sum(p.numel() for p in engine.module.parameters()) * 4 * 3
        if args.dump_loaded:
            dump_live_state(engine, Path(args.dump_loaded), tp_rank)

    losses, scales = {}, {}
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        value = torch.zeros(())
        for micro in range(args.grad_accum):
            tokens = batch(step, dp_rank, dp_size, micro, args.grad_accum)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            value += loss.detach().float()
        dist.all_reduce(value)  # mean over micro-batches and DP (TP ranks hold the same loss)
        losses[step] = value.item() / dist.get_world_size() / args.grad_accum
        scales[step] = loss_scale(engine)
        if "first_step_s" not in timing and args.load_dir:
            timing["first_step_s"] = time.perf_counter() - start
        if args.save_dir and step == args.save_at:
            if args.dump:
                dump_live_state(engine, Path(args.dump), tp_rank)
            engine.save_checkpoint(args.save_dir)
    if args.timing:
        Path(f"{args.timing}.rank{dist.get_rank()}.json").write_text(json.dumps(timing))
    if args.result and dist.get_rank() == 0:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps({"tp": args.tp, "losses": losses, "loss_scales": scales}))
    finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
