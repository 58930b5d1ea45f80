"""How long ``save_checkpoint`` blocks training with ``"async_save": {"snapshot": "copy"}`` on an accelerator,
against a synchronous save of the same engine, at a 1-3B shape (default: a 1.1B-parameter Llama, hidden 2048,
22 layers), one rank, bf16, ZeRO-1, the real engine. Run under torchrun by scripts/gpu-check.sh (absolute times
hold on a GPU; on the CPU this is the dry run's small shape).

After two warm-up steps: a synchronous save (its wall time), a first save in the background (its stall includes
allocating the pinned host buffers, once per run), then ``--rounds`` saves in the background: each one's stall
(the time ``save_checkpoint`` blocks), the seconds until it is committed, the training steps taken meanwhile and
their time against as many steps with no save in flight. Every save starts with the disk idle (``sync``). The
result (medians) goes to ``OUT/result.json``.

    torchrun --nproc_per_node 1 bench/gpu_async_stall.py --out DIR [--hidden 2048 --layers 22 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import deepspeed_ext
    from deepspeed_ext.demo.models import batch, ds_config, finish_distributed
    from deepspeed_ext.runtime import ASYNC_SAVE_ATTR, PENDING_ATTR
    from deepspeed_ext.runtime.background_save import POOL_ATTR

    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=max(1, args.hidden // 512), intermediate_size=args.hidden * 11 // 4,
                         vocab_size=32000)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    parameters = sum(param.numel() for param in model.parameters())
    engine, *_ = deepspeed_ext.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(tp=1, dp=1, zero=1, dtype="bf16", async_save="copy"))
    tokens = batch(1, 0, 1, vocab=config.vocab_size).to(engine.device)
    device = torch.get_device_module(engine.device.type) if engine.device.type != "cpu" else None

    def synchronize() -> None:
        if device is not None:
            device.synchronize()

    def step() -> None:
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()

    def timed(work) -> float:
        synchronize()
        os.sync()  # the disk idle before each save
        start = time.perf_counter()
        work()
        synchronize()
        return time.perf_counter() - start

    out = Path(args.out)
    for _ in range(2):
        step()
    setattr(engine, ASYNC_SAVE_ATTR, False)
    sync_s = timed(lambda: engine.save_checkpoint(str(out / "sync"), tag="step"))
    setattr(engine, ASYNC_SAVE_ATTR, True)

    def background_save(tag: str) -> dict[str, float]:
        stall = timed(lambda: engine.save_checkpoint(str(out / "async"), tag=tag))
        returned, during = time.perf_counter(), []
        while hasattr(engine, PENDING_ATTR):
            during.append(timed(step))
        commit_after = time.perf_counter() - returned
        alone = [timed(step) for _ in during] or [timed(step)]
        return {"stall": stall, "commit_after": commit_after, "steps": len(during),
                "during": statistics.mean(during) if during else float("nan"), "alone": statistics.mean(alone)}

    first = background_save("step")  # the same tag as the synchronous save: its files are compared
    from async_save import _same_files  # the CPU bench's check: every file, the commit marker but for its time
    same_bytes = bool(_same_files(out / "sync" / "step", out / "async" / "step"))
    rounds = [background_save(f"round{index}") for index in range(args.rounds)]
    pool = getattr(engine, POOL_ATTR)
    median = {key: statistics.median(row[key] for row in rounds) for key in rounds[0]}
    result = {"parameters": parameters, "sync_s": sync_s, "first_stall_s": first["stall"],
              "stall_s": median["stall"], "stall_ratio": median["stall"] / sync_s,
              "commit_after_s": median["commit_after"], "steps_during": median["steps"],
              "step_during_s": median["during"], "step_alone_s": median["alone"],
              "pool_gib": pool.nbytes / 2**30, "pinned": pool.pinned_nbytes == pool.nbytes and pool.nbytes > 0,
              "same_bytes": same_bytes, "rounds": rounds, "device": str(engine.device)}
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    finish_distributed()


if __name__ == "__main__":
    main()
