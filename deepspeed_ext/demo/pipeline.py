"""A pipeline-parallel training script as a user writes one for DeepSpeed's ``PipelineModule``; run under torchrun.

The model is a small language model cut into pipeline layers (embedding, residual MLP blocks, norm, head), trained
with ``engine.train_batch`` on the demo's batches, so a run at any PP / TP / DP degree sees the same data.
``--tp`` is the model-parallel axis of DeepSpeed's ``PipeModelDataParallelTopology``: these layers are plain
``nn.Linear``, so its ranks hold replicas, as in upstream's own TP x PP checkpoint test.

    torchrun --nproc_per_node 4 -m deepspeed_ext.demo.pipeline --pp 2 --tp 2 --steps 4 --save-dir ckpt --save-at 3
    torchrun --nproc_per_node 1 -m deepspeed_ext.demo.pipeline --pp 1 --tp 1 --steps 4 --load-dir ckpt
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

VOCAB, HIDDEN, LAYERS = 101, 48, 5


class Block(torch.nn.Module):
    """A residual MLP block (the pipeline's unit of work)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = hidden + self.down(torch.nn.functional.gelu(self.up(self.norm(hidden))))
        return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, required=True, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="the topology's model-parallel degree")
    p.add_argument("--layers", type=int, default=LAYERS, help="residual blocks between the embedding and the head")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-dir")
    p.add_argument("--save-at", type=int, action="append", default=[])
    p.add_argument("--load-dir")
    p.add_argument("--load-universal", action="store_true", help="set checkpoint.load_universal")
    p.add_argument("--plain", action="store_true", help="deepspeed.initialize without the deepspeed_ext section")
    p.add_argument("--freeze", help="freeze the parameters whose names match this regular expression")
    p.add_argument("--init-seed", type=int, default=1234, help="the seed of the initial weights")
    p.add_argument("--seed-per-rank", action="store_true",
                   help="seed each rank's initial weights by its rank (seed + rank), as scripts that seed per process "
                        "do: at TP>1 each model-parallel rank then trains its own copy of the plain layers")
    p.add_argument("--result", help="write the losses (JSON) here")
    return p.parse_args(argv)


def build(pp: int, tp: int, blocks: int = LAYERS, seed: int = 1234) -> Any:
    """The PipelineModule, the same initial weights at every degree."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (pp * tp):
        raise SystemExit(f"world size {world} is not a multiple of PP x TP = {pp * tp}")
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
    torch.manual_seed(seed)
    layers = [LayerSpec(torch.nn.Embedding, VOCAB, HIDDEN), *[LayerSpec(Block) for _ in range(blocks)],
              LayerSpec(torch.nn.LayerNorm, HIDDEN), LayerSpec(torch.nn.Linear, HIDDEN, VOCAB)]
    return PipelineModule(layers=layers, topology=topology, loss_fn=lm_loss, partition_method="uniform")


def run(argv: list[str] | None = None) -> dict[int, float]:
    args = parse_args(argv)
    import deepspeed
    import torch.distributed as dist

    import deepspeed_ext
    from deepspeed_ext.demo.models import GLOBAL_BATCH, batch
    deepspeed.init_distributed(dist_backend="gloo")
    model = build(args.pp, args.tp, args.layers, args.init_seed + (dist.get_rank() if args.seed_per_rank else 0))
    if args.freeze:
        import re
        for name, param in model.named_parameters():
            if re.search(args.freeze, name):
                param.requires_grad_(False)
    world = dist.get_world_size()
    dp = world // (args.pp * args.tp)
    config: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "steps_per_print": 1000, "pipeline": {"activation_checkpoint_interval": 0},
    }
    if not args.plain:
        config["deepspeed_ext"] = {"universal_checkpoint": {"enabled": True}}
    if args.load_universal:
        config["checkpoint"] = {"load_universal": True}
    init = deepspeed.initialize if args.plain else deepspeed_ext.initialize
    engine, _, _, _ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                           config=config)
    if args.load_dir:
        engine.load_checkpoint(args.load_dir)
    dp_rank = engine.grid.get_data_parallel_rank()
    losses: dict[int, float] = {}
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        tokens = batch(step, dp_rank, dp)
        loss = engine.train_batch(data_iter=iter([(tokens, tokens)]))
        # The last stage computes the loss; train_batch broadcasts its mean over DP to every stage.
        losses[step] = float(loss)
        if args.save_dir and step in args.save_at:
            engine.save_checkpoint(args.save_dir)
    if args.result and dist.get_rank() == 0:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps({"pp": args.pp, "tp": args.tp, "losses": losses}))
    return losses


def main(argv: list[str] | None = None) -> None:
    from deepspeed_ext.demo.models import finish_distributed
    losses = run(argv)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        print("losses", json.dumps(losses))
    finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
