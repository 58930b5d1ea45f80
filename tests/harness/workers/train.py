"""The demo's training script (``deepspeed_ext.demo.train``) with the probes the tests need; run under torchrun.

    --dump DIR          at save time, each TP rank's live fp32 master and Adam moments (TP-local, full over DP)
                        and the logits of a fixed batch, into DIR/tp_rank_<r>.pt and DIR/logits_tp_rank_<r>.pt
    --dump-loaded DIR   the same, right after load_checkpoint
    --allow-cpu-fp16    let DeepSpeed's CPU accelerator run fp16 (see allow_cpu_fp16)
    --also-save-without-latest DIR   at save time, first engine.save_checkpoint(DIR, save_latest=False)
    --also-save-synchronously DIR    at save time, first a synchronous engine.save_checkpoint(DIR) (the run saves
                        in the background otherwise: --async-save)
    --writer-ends-before-next-step   after each save, wait until the background writer has exited, unreaped
    --save-errors FILE  after each save, wait for it (deepspeed_ext.wait_for_saves); a failure is appended to FILE
                        (JSON lines: step, rank, message) and training goes on

With ``--result``, the fp16 loss scale each step ended with is recorded under ``loss_scales``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
# This script's directory: the protocol it shares with harness.runner.
from pool_claim import claim, open_wake_channel, wait_for_wake, wake

STATES = ("fp32", "exp_avg", "exp_avg_sq")  # Adam's; another optimizer's are its own keys (tensor_state_keys)


def tensor_state_keys(state: dict[str, Any]) -> list[str]:
    """The keys of a torch optimizer state entry that hold tensors of the parameter's elements (not the step)."""
    return [key for key, value in state.items() if torch.is_tensor(value) and value.dim() > 0]


def _stage0_live_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Without ZeRO DeepSpeed has no fragment API: read its optimizer's own objects, where deepspeed-ext's
    stage-0 decoder (the one the restore uses) says each parameter's state lies."""
    from deepspeed_ext.checkpoint import engine_private
    slots = engine_private.live_slots(engine.optimizer)
    torch_optimizer = engine_private.wrapped_optimizer(engine.optimizer)
    state = {}
    for name, param in engine.module.named_parameters():
        slot = slots.get(param)
        if slot is None or param.numel() == 0:
            continue  # not optimized, or an empty shard (filled in by dump_live_state)
        keys = tensor_state_keys(torch_optimizer.state.get(slot.key, {}))
        state[name] = {"fp32": slot.master_of().view(param.shape).clone(),
                       **{key: slot.moment_of(torch_optimizer, key).view(param.shape).clone() for key in keys}}
    return state


def _link_moment_fragments(engine: Any) -> None:
    """DeepSpeed 0.19.8 (ZeRO-1/2) never links AutoEP expert parameters' Adam fragments to the optimizer's state
    (its ``safe_get_full_optimizer_state`` raises ``exp_avg not found in optimizer state fragment`` for them), as
    it does for dense ones at each step: link them, with DeepSpeed's own call, to DeepSpeed's own flat state."""
    from deepspeed.utils import groups
    base = getattr(engine.optimizer, "optimizer", None)
    for param in engine.module.parameters():
        if getattr(param, "_dp_group", False) is None and getattr(param, "group_name", None):
            # Nor the group its fragments are gathered over (the ranks holding the same experts), where there are
            # several of them: the group DeepSpeed partitions them over.
            param._dp_group = groups._get_expert_data_parallel_group(param.group_name)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None or mapping.optim_fragment or base is None:
            continue
        flat = base.param_groups[mapping.param_group_index]["params"][0]
        if flat in base.state:
            mapping.set_optim_state_fragment(flat, base.state[flat])


def _state_keys_of(engine: Any, base: Any, param: Any) -> list[str]:
    """The tensor states the optimizer keeps for ``param``'s param group (the same on every rank)."""
    if hasattr(param, "ds_id"):  # ZeRO-3: the flat partition of the parameter's sub-group
        optimizer = engine.optimizer
        flat = next(flat for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_partitioned_groups_flat)
                    if any(p is param for p in params))
        return tensor_state_keys(base.state.get(flat, {}))
    groups = getattr(engine.optimizer, "bit16_groups", None) or engine.optimizer.bf16_groups  # BF16_Optimizer's
    group = next(index for index, params in enumerate(groups) if any(p is param for p in params))
    return tensor_state_keys(base.state.get(base.param_groups[group]["params"][0], {}))


def _muon_whole_momentum(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's Muon under ZeRO-1/2 keeps a param group's momentum for the *whole* parameters of each rank's
    partition (its ``params_in_partition``, one after another), which DeepSpeed's fragment API cannot cut: each
    parameter's TP-local momentum, read from DeepSpeed's own buffers on the ranks that hold it, gathered over DP."""
    import torch.distributed as dist
    optimizer = engine.optimizer
    base = getattr(optimizer, "optimizer", None)
    partitions = getattr(optimizer, "params_in_partition", None)
    if partitions is None or "muon" not in type(base).__name__.lower() or getattr(optimizer, "cpu_offload", False):
        return {}
    names = {id(param): name for name, param in engine.module.named_parameters()}
    mine = {}
    for group, params in enumerate(partitions):
        flat = base.param_groups[group]["params"][0]
        momentum = base.state.get(flat, {}).get("momentum_buffer")
        if not params or momentum is None or not base.param_groups[group].get("use_muon"):
            continue
        offset = 0
        for param in params:
            mine[names[id(param)]] = momentum[offset:offset + param.numel()].view(param.shape).clone()
            offset += param.numel()
    gathered: list[Any] = [None] * dist.get_world_size(group=engine.optimizer.dp_process_group)
    dist.all_gather_object(gathered, mine, group=engine.optimizer.dp_process_group)
    found: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, value in part.items():
            assert name not in found or torch.equal(found[name], value), f"{name}: DP ranks' momentum copies differ"
            found[name] = value
    return found


def _has_moments(engine: Any) -> bool:
    """Whether the optimizer holds Adam moments (torch's Adam creates them at its first step)."""
    base = getattr(engine.optimizer, "optimizer", None)
    return any(state for state in getattr(base, "state", {}).values())


def dump_live_state(engine: Any, path: Path, tp_rank: int) -> None:
    """The TP-local full fp32 master weights and Adam moments, gathered over DP by DeepSpeed itself."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from deepspeed_ext.demo.models import eval_batch
    if not engine.zero_optimization():
        state = _stage0_live_state(engine)
    else:
        _link_moment_fragments(engine)
        moments = _has_moments(engine)
        whole = _muon_whole_momentum(engine)
        base = engine.optimizer.optimizer
        state = {}
        for name, param in engine.module.named_parameters():
            if torch.Size(getattr(param, "ds_shape", param.shape)).numel() == 0 or not param.requires_grad:
                continue
            fp32 = safe_get_full_fp32_param(param).clone()
            if not moments:  # a fresh optimizer (before its first step) has none yet: zeros
                state[name] = {"fp32": fp32, **{key: torch.zeros_like(fp32) for key in STATES[1:]}}
                continue
            keys = _state_keys_of(engine, base, param)
            state[name] = {"fp32": fp32, **{key: whole[name] if key == "momentum_buffer" and name in whole else
                                            safe_get_full_optimizer_state(param, key).clone() for key in keys}}
    for name, param in engine.module.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if not param.requires_grad and torch.Size(shape).numel():  # frozen: its weights alone (ZeRO-3: gathered)
            import deepspeed
            with deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") else contextlib.nullcontext():
                state[name] = {"fp32": param.data.float().clone()}
            continue
        if torch.Size(shape).numel() == 0:
            # A rank beyond the KV-head count holds no attention shard; DeepSpeed leaves such empty
            # parameters out of the optimizer, so they have no fp32 master or moments to ask for (empty tensors
            # under every state key this rank's optimizer keeps).
            seen = {key for states in state.values() for key in states} or set(STATES)
            state[name] = {key: torch.zeros(shape) for key in seen}
    from deepspeed_ext.checkpoint.model_config import persistent_buffers
    for name, buffer in persistent_buffers(engine.module).items():  # carried as tensors no optimizer steps
        # fp32 as the masters; an integer buffer (DeepSeek-V4's hash-routing table) in its own dtype
        value = buffer.detach().float() if buffer.is_floating_point() else buffer.detach()
        state[name] = {"fp32": value.clone(), "exp_avg": torch.zeros_like(value),
                       "exp_avg_sq": torch.zeros_like(value)}
    with torch.no_grad():  # every rank runs the forward: TP (and ZeRO-3) layers communicate
        logits = engine.module(input_ids=eval_batch()).logits.float()
    from deepspeed_ext.checkpoint.engine_private import autoep_layers
    layers = autoep_layers(engine.module)
    if layers:  # AutoEP: each rank holds its EP rank's experts (gathered over the ranks holding the same ones)
        path.mkdir(parents=True, exist_ok=True)
        experts = {name: state[name] for layer in layers for name in layer.params if name in state}
        torch.save({"ep_rank": layers[0].ep_rank, "state": experts},
                   path / f"experts_rank_{engine.global_rank:02d}.pt")
    if engine.global_rank == tp_rank:  # DP rank 0 of each TP rank writes
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state, path / f"tp_rank_{tp_rank:02d}.pt")
        # Full logits, or this rank's vocab shard where the output projection is vocab-parallel.
        torch.save(logits, path / f"logits_tp_rank_{tp_rank:02d}.pt")


def allow_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator reports fp16 unsupported unless oneDNN has native fp16 kernels
    (AVX512-FP16/AMX-FP16). That is a speed gate: torch computes fp16 correctly on any CPU, only slower.
    Lifting it lets the real fp16 path (FP16 optimizers, dynamic loss scaler) run on such machines."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def loss_scale(engine: Any, step: int) -> float | None:
    """The optimizer's current loss scale (fp16), or None without loss scaling."""
    optimizer = engine.optimizer
    scaler = getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)
    return float(scaler.cur_scale) if scaler is not None and hasattr(scaler, "cur_scale") else None


def grad_norm(engine: Any, step: int) -> float | None:
    """The global gradient norm the engine clipped with at this step."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def writer_ended(engine: Any, limit_s: float = 120.0) -> None:
    """Wait until this rank's background writer has exited, without reaping it or asking how it went: the next
    ``engine.step()`` finds out, as it would at any later step, however fast the steps are against the writer."""
    from deepspeed_ext.runtime import PENDING_ATTR
    pending = getattr(engine, PENDING_ATTR, None)
    deadline = time.monotonic() + limit_s
    while pending is not None and time.monotonic() < deadline:
        if pending.pid is None:  # a writer thread (the copy snapshot)
            if pending.ended():
                return
        elif os.waitid(os.P_PID, pending.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.05)


def run_with_probes(argv: list[str]) -> None:
    """One run of the demo's training script (``train.run``), with the probes its arguments ask for."""
    from deepspeed_ext.demo import train
    probes = argparse.ArgumentParser(add_help=False)
    probes.add_argument("--dump")
    probes.add_argument("--dump-loaded")
    probes.add_argument("--allow-cpu-fp16", action="store_true")
    probes.add_argument("--also-save-without-latest")
    probes.add_argument("--also-save-synchronously")
    probes.add_argument("--save-errors")
    probes.add_argument("--writer-ends-before-next-step", action="store_true")
    probes.add_argument("--record-grad-norms", action="store_true",
                        help="the result's per-step record is the engine's global gradient norm, not the loss scale")
    args, rest = probes.parse_known_args(argv)
    if args.allow_cpu_fp16:
        allow_cpu_fp16()

    def before_save(engine: Any, tp_rank: int) -> None:
        if args.dump:
            dump_live_state(engine, Path(args.dump), tp_rank)
        if args.also_save_without_latest:
            engine.save_checkpoint(args.also_save_without_latest, save_latest=False)
        if args.also_save_synchronously:
            from deepspeed_ext.runtime import ASYNC_SAVE_ATTR
            setattr(engine, ASYNC_SAVE_ATTR, False)
            engine.save_checkpoint(args.also_save_synchronously)
            setattr(engine, ASYNC_SAVE_ATTR, True)

    def after_save(engine: Any, step: int) -> None:
        import json

        import deepspeed_ext
        from deepspeed_ext.errors import CheckpointError
        if args.writer_ends_before_next_step:
            writer_ended(engine)
        if not args.save_errors:
            return
        try:
            deepspeed_ext.wait_for_saves(engine)
        except CheckpointError as exc:
            with open(args.save_errors, "a") as errors:
                errors.write(json.dumps({"step": step, "rank": engine.global_rank, "message": str(exc)}) + "\n")

    hooks = train.Hooks(
        after_load=(lambda engine, tp_rank: dump_live_state(engine, Path(args.dump_loaded), tp_rank))
        if args.dump_loaded else None,
        before_save=before_save if args.dump or args.also_save_without_latest or args.also_save_synchronously
        else None,
        after_save=after_save if args.save_errors or args.writer_ends_before_next_step else None,
        after_step=grad_norm if args.record_grad_norms else loss_scale,
        result_key="grad_norms" if args.record_grad_norms else "loss_scales")
    train.run(rest, hooks)


#: DeepSpeed's module globals that hold the groups an engine set up (those ``groups._release_process_group_references``
#: resets), and its tables of expert-parallel groups.
_GROUP_GLOBALS = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                  "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                  "_MPU_TENSOR_MODEL_PARALLEL_RANK", "expert_tensor_parallel_world_size", "mesh_device", "mpu")
_GROUP_TABLES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")
#: Those values as the runs at each TP degree this process served left them.
_GROUPS_BY_DEGREE: dict[str, dict[str, Any]] = {}


def switch_tensor_parallel_groups(old: str, new: str) -> None:
    """Let the next engine in this process run at another TP degree: DeepSpeed sets its groups once a process
    (module globals) and keeps them. The groups of degree ``old`` are put aside and those of ``new`` put back where
    this process ran at it before; otherwise DeepSpeed's are dropped as DeepSpeed drops them when its world group is
    destroyed, and the next engine's collective setup makes fresh ones on every rank alike. Put aside, not made
    afresh at each change: gloo keeps a thread polling every group's sockets (about 0.3% of a core each), the groups
    dropped at a change kept theirs (destroying them too did not end the threads), and pools that changed degree at
    most runs held 158 such threads in one CI run, 357 s of its CPU."""
    from deepspeed.utils import groups
    _GROUPS_BY_DEGREE[old] = {**{name: getattr(groups, name) for name in _GROUP_GLOBALS},
                              **{name: dict(getattr(groups, name)) for name in _GROUP_TABLES}}
    groups._release_process_group_references(None)
    for name, value in _GROUPS_BY_DEGREE.get(new, {}).items():
        if name in _GROUP_TABLES:
            getattr(groups, name).update(value)
        else:
            setattr(groups, name, value)


def serve(directory: Path) -> None:
    """Answer run requests until told to stop, each run a fresh model and engine in these processes (the process
    group kept): what ``harness.runner``'s pool of workers asks for. Request N is ``DIRECTORY/N.json`` (``runs``: a
    list of argument lists; ``log``: where this run's output goes); rank 0 writes ``N.done`` once every rank has
    finished it. A run that raises ends the pool: the rank prints the traceback into the run's log and exits, and
    torchrun stops the other ranks, which may be waiting for it in a collective."""
    import json
    import sys
    import traceback

    import torch.distributed as dist

    from deepspeed_ext.demo.models import finish_distributed

    @contextlib.contextmanager
    def output_to(log: str):  # the file descriptors, so that DeepSpeed's and torch's own output follows too
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        target = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, 1)
        os.dup2(target, 2)
        os.close(target)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])

    rank = int(os.environ["RANK"])
    (directory / f"pid.{rank}").write_text(str(os.getpid()))
    owner = int(os.environ.get("DSX_TEST_POOL_OWNER", "0"))  # harness.runner.OWNER_ENV
    number, tp_degree = 0, None
    channel = open_wake_channel(directory, rank)  # before the first look for a request: no wake-up is missed
    while True:
        request = directory / f"{number}.json"
        idle_since = checked = time.monotonic()
        while not request.exists():
            if (directory / "stop").exists():
                finish_distributed()
            if owner and not _alive(owner):  # the test process is gone without a word: leave, no collective
                os._exit(0)
            now = time.monotonic()
            if rank == 0 and now - idle_since > IDLE_S and now - checked > 1:
                checked = now
                if _available_bytes() < LOW_MEMORY_BYTES and claim(directory, number):
                    (directory / "stop").write_text("released")  # every rank leaves; the owner starts a new pool
                    wake(directory)
            wait_for_wake(channel, 1.0)  # woken by a request or stop (pool_claim.wake), else once a second
        spec = json.loads(request.read_text())
        with output_to(spec["log"]):
            try:
                for run in spec["runs"]:
                    degree = run[run.index("--tp") + 1]
                    if tp_degree not in (None, degree):
                        switch_tensor_parallel_groups(tp_degree, degree)
                    tp_degree = degree
                    run_with_probes(run)
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        dist.barrier()
        if rank == 0:
            (directory / f"{number}.done").write_text("")
        number += 1


#: An idle pool gives its memory back when the machine runs short: three test processes' pools once held most of
#: CI's 24 GiB while idle, and the kernel killed a test process that needed more.
IDLE_S = float(os.environ.get("DSX_TEST_POOL_IDLE_S", "10"))
LOW_MEMORY_BYTES = int(os.environ.get("DSX_TEST_POOL_LOW_MEMORY", str(4 << 30)))


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 1 << 62


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    """``train.py ARGS`` is one run; ``train.py --serve DIR``: runs as they are asked for (``serve``), each with a
    fresh model and engine in these processes: a process start (importing torch, DeepSpeed and transformers)
    costs more than a run of the tiny models."""
    import sys

    from deepspeed_ext.demo.models import finish_distributed
    argv = sys.argv[1:]
    if argv[:1] == ["--serve"]:
        serve(Path(argv[1]))  # ends the process when asked to stop
    else:
        run_with_probes(argv)
        finish_distributed()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
