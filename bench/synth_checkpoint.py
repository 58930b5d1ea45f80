"""A DeepSpeed AutoTP checkpoint at real shapes, written without training it.

The real engine cannot train a model with Llama-3-8B's shapes on a 24 GiB machine (one step holds about 16-20
bytes per parameter), yet the memory targets are about those shapes. This writes the checkpoint that DeepSpeed
0.19.8 saves after one step of a TP=2, DP=1, ZeRO-1, bf16 AutoTP run of a Llama with deepspeed-ext enabled:

* ``mp_rank_0R_model_states.pt``: the rank's bf16 weights, views into one flat buffer (ZeRO flattens them), with
  ``param_shapes``, the DeepSpeed config, the step counters and upstream's ``universal_checkpoint_info``
  (the row / replicated / vocabulary patterns and the affine map of every TP slice);
* ``bf16_zero_pp_rank_0_mp_rank_0R_optim_states.pt``: the flat fp32 partition, ``exp_avg``, ``exp_avg_sq``,
  ``param_slice_mappings``, the paddings, the loss scaler, torch's Adam param group;
* ``deepspeed_ext.json`` (the TP layouts, the model config and the resume fingerprints, so conversions check
  them), ``latest``, and DeepSpeed's recovery scripts beside the tag, as the engine copies them.

The structure was read off a real engine run; ``tests/e2e/test_synth_checkpoint.py`` keeps it honest by
training the real engine one step on a small Llama and comparing the two checkpoints file by file, key by key.

Values come from a seeded RNG, per (parameter, state, block of rows of the full tensor), so any rank's slice of
any tensor can be produced alone and :func:`full_tensor` gives back what was meant. Every large tensor is
streamed: ``torch.save`` writes each file around uninitialized placeholders (``skip_data``; untouched pages
cost no memory), then the blocks go in with ``pwrite`` at the offsets torch gave their storages. The generator
stays at a few hundred MB of RSS whatever the model's size.

    python bench/synth_checkpoint.py --shapes llama3-8b --out /tmp/deepspeed_ext_bench/synth_llama3_8b
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints, partial_sums  # noqa: E402
from deepspeed_ext.checkpoint.metadata import UCInfo, write_uc_info  # noqa: E402
from deepspeed_ext.checkpoint.serialization import pwrite_all  # noqa: E402
from deepspeed_ext.module_inject.layout import TPLayout, num_kv_heads_of, shard_sizes  # noqa: E402

#: Model shapes by name: the HF config values that differ from transformers' LlamaConfig defaults.
SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3-8B's tensors, 2 layers: 1.49B parameters, embedding and untied head 0.53B each.
    "llama3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
    # Llama-3.1-70B's and 405B's tensors, one layer each (--sparse: their memory bound, no disk): 2.96B and 7.39B
    # parameters, embedding and head 1.05B / 2.10B each.
    "llama3-70b": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 1,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128},
    "llama3-405b": {"vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 1,
                    "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 128},
    # The validation test's size: GQA, a vocabulary that TP=2 splits unevenly, intermediate / hidden = 3.5.
    "small": {"vocab_size": 1001, "hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32},
}

#: Elements per generated block of a full tensor (whole rows): bounds the generator's memory.
BLOCK_ELEMENTS = 1 << 22
#: DeepSpeed ZeRO-1/2 aligns each flat group to this many elements per DP rank (4 bytes of 16-bit values).
NCCL_START_ALIGNMENT = 2
STATES = ("fp32", "exp_avg", "exp_avg_sq")
#: Column-parallel (dim 0) and row-parallel (dim 1) Linear weights of a Llama layer, as AutoTP splits them.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def llama_config_dict(shapes: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` the model is built from (what ``--model-config`` of the demo's trainer takes)."""
    import transformers
    config = transformers.LlamaConfig(**shapes, max_position_embeddings=64, tie_word_embeddings=False)
    return dict(json.loads(config.to_json_string(use_diff=False)))


@dataclass(frozen=True)
class Param:
    """One parameter: its name, TP layout and per-rank offset in the rank's flat ZeRO group."""

    name: str
    layout: TPLayout

    @property
    def rows(self) -> int:
        return self.layout.shape[0]

    @property
    def cols(self) -> int:
        return math.prod(self.layout.shape[1:])

    def local_numel(self, rank: int) -> int:
        return math.prod(self.layout.local_shape(rank))


@dataclass
class Plan:
    """What the engine would hold: the model config, the DeepSpeed config, and each parameter's layout."""

    config: dict[str, Any]
    ds_config: dict[str, Any]
    params: list[Param]
    tp: int
    seed: int
    steps: int = 1

    @property
    def layouts(self) -> dict[str, TPLayout]:
        return {p.name: p.layout for p in self.params}

    def rank_numel(self, rank: int) -> int:
        return sum(p.local_numel(rank) for p in self.params)


def make_plan(config: dict[str, Any], tp: int = 2, seed: int = 0) -> Plan:
    """The parameters of the Llama that ``config`` describes (built on the meta device: no memory), with the TP
    layout AutoTP gives each, cut by deepspeed-ext's own rule (:func:`shard_sizes`)."""
    import transformers

    from deepspeed_ext.demo.models import ds_config
    values = dict(config)
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    kv_heads = num_kv_heads_of(hf_config)
    params = []
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        module = name.rsplit(".", 2)[-2]
        if name == "lm_head.weight":  # untied: AutoTP splits the head's vocabulary (dim 0)
            layout = TPLayout.split(shape, tp, 0, shard_sizes(shape[0], tp, name=name, num_kv_heads=kv_heads),
                                    "column", role="vocab")
        elif module in _COLUMN:
            layout = TPLayout.split(shape, tp, 0, shard_sizes(shape[0], tp, name=name, num_kv_heads=kv_heads),
                                    "column")
        elif module in _ROW:
            layout = TPLayout.split(shape, tp, 1, shard_sizes(shape[1], tp, name=name, num_kv_heads=kv_heads), "row")
        else:  # the embedding (AutoTP keeps it whole) and the norms
            layout = TPLayout.replicated(shape, tp)
        params.append(Param(name, layout))
    # The config the demo's trainer passes to deepspeed_ext.initialize: the engine saves it as given.
    return Plan(config=json.loads(hf_config.to_json_string(use_diff=False)), ds_config=ds_config(tp=tp),
                params=params, tp=tp, seed=seed)


# ----------------------------------------------------------------------------------------------------- values
def _block_rows(param: Param) -> int:
    return max(1, BLOCK_ELEMENTS // max(param.cols, 1))


def full_block(plan: Plan, param: Param, state: str, block: int) -> torch.Tensor:
    """Rows ``[block * n, (block + 1) * n)`` of the full tensor ``state`` of ``param``, as ``(rows, cols)``
    fp32: from a generator seeded by (seed, name, state, block) alone, so any slice is reproducible alone."""
    n = _block_rows(param)
    rows = min(n, param.rows - block * n)
    key = f"{plan.seed}:{param.name}:{state}:{block}".encode()
    generator = torch.Generator().manual_seed(zlib.crc32(key) | (plan.seed << 32))
    values = torch.randn(rows, param.cols, generator=generator)
    if state == "fp32":
        # Norm weights near one, matrices at a typical init scale.
        return values.mul_(0.02).add_(1.0) if len(param.layout.shape) == 1 else values.mul_(0.02)
    if state == "exp_avg":
        return values.mul_(1e-3)
    return values.mul_(1e-3).square_()  # exp_avg_sq: a square, never negative


def full_tensor(plan: Plan, name: str, state: str) -> torch.Tensor:
    """The whole tensor ``state`` of parameter ``name`` (for checks at small sizes)."""
    param = next(p for p in plan.params if p.name == name)
    blocks = -(-param.rows // _block_rows(param))
    return torch.cat([full_block(plan, param, state, b) for b in range(blocks)]).reshape(param.layout.shape)


def local_blocks(plan: Plan, param: Param, state: str, rank: int) -> Iterator[torch.Tensor]:
    """TP rank ``rank``'s slice of the full tensor, in row-major order, block by block (each contiguous)."""
    layout, n = param.layout, _block_rows(param)
    if layout.partition_dim == 1:  # row-parallel: every row, the rank's columns
        (offset, width), = layout.rank_pieces(rank)
        for block in range(-(-param.rows // n)):
            yield full_block(plan, param, state, block)[:, offset:offset + width].contiguous()
        return
    if layout.is_replicated:
        first, count = 0, param.rows
    else:
        (first, count), = layout.rank_pieces(rank)
    for block in range(first // n, -(-(first + count) // n)):
        low = max(first, block * n) - block * n
        high = min(first + count, (block + 1) * n) - block * n
        yield full_block(plan, param, state, block)[low:high]


# ----------------------------------------------------------------------------------------------------- files
def _ds_objects() -> dict[str, Any]:
    """DeepSpeed's own data classes, which its checkpoint pickles name (imported, not re-created)."""
    from deepspeed.checkpoint.affine import AFFINE_MAP_FORMAT_VERSION
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_VALUE
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    import deepspeed
    return {"LossScaler": LossScaler, "ZeroStageEnum": ZeroStageEnum, "fragment_address": fragment_address,
            "uc_version": UNIVERSAL_CHECKPOINT_VERSION_VALUE, "affine_version": AFFINE_MAP_FORMAT_VERSION,
            "version": deepspeed.__version__}


def _pattern(name: str) -> str:
    return f"^{re.escape(name)}$"


def universal_checkpoint_info(plan: Plan) -> dict[str, Any]:
    """Upstream's model-level UC info, as the engine records it for AutoTP: the patterns (sorted), and the
    affine map: for each rank, where its slice lies in the full tensor (flat offset and strides)."""
    ds = _ds_objects()
    split = [p for p in plan.params if not p.layout.is_replicated]
    replicated = [p for p in plan.params if p.layout.is_replicated]
    affine: dict[str, Any] = {}
    for param in split + replicated:  # split parameters first, then the replicated ones, each in module order
        layout = param.layout
        full_strides = list(torch.empty(layout.shape, device="meta").stride())
        ranks = {}
        for rank in range(plan.tp):
            local = list(layout.local_shape(rank))
            local_strides = list(torch.empty(local, device="meta").stride())
            if layout.is_replicated:
                source, locations = 0, list(range(plan.tp))
            else:
                (offset, _), = layout.rank_pieces(rank)
                dim = int(layout.partition_dim or 0)
                source, locations = offset * full_strides[dim], [rank]
            ranks[rank] = {"shard_shape": local,
                           "pieces": [{"shape": local, "source": [source, full_strides], "dest": [0, local_strides],
                                       "locations": locations}]}
        affine[_pattern(param.name)] = {"logical_shape": list(layout.shape), "ranks": ranks}
    vocab = plan.config["vocab_size"]
    return {
        "universal_checkpoint_version": ds["uc_version"],
        "parameter_with_row_parallelism_patterns": sorted(_pattern(p.name) for p in split
                                                          if p.layout.partition_dim == 1),
        "tp_replicated_parameter_patterns": sorted(_pattern(p.name) for p in replicated),
        "vocabulary_parameter_patterns": sorted(_pattern(p.name) for p in split if p.layout.role == "vocab"),
        "parameter_with_sub_params": [],
        "autotp_unsupported_parameter_patterns": {},
        "original_vocab_size": vocab,
        "affine_map": {"version": ds["affine_version"], "params": affine},
    }


def _adam_param_groups(plan: Plan) -> list[dict[str, Any]]:
    """The param group of the torch optimizer DeepSpeed builds for ``"Adam"`` with ``torch_adam`` (AdamW with
    DeepSpeed's default weight decay), as torch itself writes it."""
    params = plan.ds_config["optimizer"]["params"]
    optimizer = torch.optim.AdamW([torch.zeros(1)], lr=params["lr"], weight_decay=0.01)
    return list(optimizer.state_dict()["param_groups"])


def rank_objects(plan: Plan, rank: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """The model-states and optimizer-states objects of TP rank ``rank``, holding uninitialized placeholders
    (never touched, so never resident), and the placeholders by role (``bf16``, and each state)."""
    ds = _ds_objects()
    numel = plan.rank_numel(rank)
    if numel % NCCL_START_ALIGNMENT:
        # DeepSpeed would pad the flat group; the padding is not modelled (Llama's shapes never need it).
        raise NotImplementedError(f"rank {rank} holds {numel} elements, not a multiple of {NCCL_START_ALIGNMENT}")
    flat_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    module, shapes, mappings, position = {}, {}, {}, 0
    for param in plan.params:
        local = param.layout.local_shape(rank)
        count = math.prod(local)
        module[param.name] = flat_bf16[position:position + count].view(local)
        shapes[param.name] = torch.Size(local)
        mappings[param.name] = ds["fragment_address"](numel=count, start=position)
        position += count
    placeholders = {"bf16": flat_bf16, **{state: torch.empty(numel) for state in STATES},
                    "step": torch.tensor(float(plan.steps))}
    world = plan.tp  # DP=1: the world is one TP group
    micro = plan.ds_config["train_micro_batch_size_per_gpu"]
    accum = plan.ds_config.get("gradient_accumulation_steps", 1)
    from collections import OrderedDict
    model_states = {
        "module": OrderedDict(module),
        "buffer_names": [],  # Llama's only buffer (rotary inv_freq) is not persistent
        "optimizer": None,
        "param_shapes": [OrderedDict(shapes)],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": plan.steps,
        # DeepSpeed counts the batch over the whole world, TP ranks included.
        "global_samples": plan.steps * micro * accum * world,
        "dp_world_size": 1,
        "mp_world_size": plan.tp,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": plan.tp},
        "ds_config": plan.ds_config,
        "ds_version": ds["version"],
        "universal_checkpoint_info": universal_checkpoint_info(plan),
    }
    groups = _adam_param_groups(plan)
    optim_states = {
        "optimizer_state_dict": {
            "loss_scaler": ds["LossScaler"](scale=1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": float(plan.ds_config.get("gradient_clipping", 0.0)),
            "base_optimizer_state": {
                "state": {0: {"step": placeholders["step"], "exp_avg": placeholders["exp_avg"],
                              "exp_avg_sq": placeholders["exp_avg_sq"]}},
                "param_groups": groups,
            },
            "single_partition_of_fp32_groups": [placeholders["fp32"]],
            "zero_stage": ds["ZeroStageEnum"](plan.ds_config["zero_optimization"]["stage"]),
            "group_paddings": [0],
            "param_alignment_paddings": [[0] * len(plan.params)],
            "partition_count": [1],
            "ds_version": ds["version"],
            "param_slice_mappings": [OrderedDict(mappings)],
        },
        "ds_config": plan.ds_config,
        "ds_version": ds["version"],
    }
    return model_states, optim_states, placeholders


def _storage_offsets(path: Path, obj: Any) -> dict[int, int]:
    """Where in the torch file ``path`` (``torch.save`` of ``obj``) each of ``obj``'s tensor storages begins, by
    the storage's address in this process: the file is memory-mapped by ``torch.load`` and each loaded storage's
    address is taken against the mapping (no data page is read)."""
    import mmap
    # A shared mapping: a private one of a file larger than the machine's memory (405B's optimizer partition, 57
    # GB) is refused by the kernel's overcommit check; nothing is written through it.
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        loaded = torch.load(path, mmap=True, weights_only=False, map_location="cpu")
    target = str(path.resolve())
    base = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                low, offset = int(fields[0].split("-")[0], 16), int(fields[2], 16)
                base = low - offset if base is None else min(base, low - offset)
    if base is None:
        raise RuntimeError(f"{path}: not memory-mapped")
    offsets: dict[int, int] = {}

    def walk(original: Any, copy: Any) -> None:  # the loaded object has the saved one's structure
        if torch.is_tensor(original):
            offsets[original.untyped_storage().data_ptr()] = copy.untyped_storage().data_ptr() - base
        elif isinstance(original, dict):
            for key, value in original.items():
                walk(value, copy[key])
        elif isinstance(original, (list, tuple)):
            for value, other in zip(original, copy, strict=True):
                walk(value, other)

    walk(obj, loaded)
    del loaded
    return offsets


class _Skeleton:
    """A torch file written around placeholders, open for ``pwrite`` of their bytes; published by :meth:`close`."""

    def __init__(self, obj: Any, path: Path):
        from deepspeed_ext.checkpoint.serialization import zip_crc32
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        with zip_crc32(False), torch.serialization.skip_data():
            torch.save(obj, self.tmp)
        self._offsets = _storage_offsets(self.tmp, obj)
        self.fd = os.open(self.tmp, os.O_RDWR)

    def offset(self, placeholder: torch.Tensor) -> int:
        """The file offset of ``placeholder``'s first element."""
        return (self._offsets[placeholder.untyped_storage().data_ptr()]
                + int(placeholder.storage_offset()) * placeholder.element_size())

    def write(self, block: torch.Tensor, position: int) -> int:
        return pwrite_all(self.fd, block.reshape(-1).view(torch.uint8).numpy(), position)

    def close(self) -> None:
        os.close(self.fd)
        os.replace(self.tmp, self.path)


def write_rank(plan: Plan, tag_dir: Path, rank: int, sums: dict[tuple[str, str], list[float]],
               sparse: bool = False) -> None:
    """Both files of TP rank ``rank``; adds the sums of what the rank owns (its slice; replicated: rank 0) to
    ``sums[(name, state)] = [numel, sum, sum of squares]``. ``sparse``: every value zero, left as the files' holes
    (no disk, no time)."""
    model_states, optim_states, placeholders = rank_objects(plan, rank)
    model = _Skeleton(model_states, tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    optim = _Skeleton(optim_states, tag_dir / f"bf16_zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt")
    optim.write(placeholders["step"], optim.offset(placeholders["step"]))  # skip_data left out small tensors too
    if sparse:
        for param in plan.params:
            if rank == 0 or not param.layout.is_replicated:
                for key in (*STATES, "module"):
                    sums.setdefault((param.name, key), [0, 0.0, 0.0])[0] += param.local_numel(rank)
        model.close()
        optim.close()
        return
    for state in STATES:
        position = optim.offset(placeholders[state])
        bf16_position = model.offset(placeholders["bf16"])
        for param in plan.params:
            owned = rank == 0 or not param.layout.is_replicated
            for block in local_blocks(plan, param, state, rank):
                position = optim.write(block, position)
                summed = [(state, block)]
                if state == "fp32":  # the engine's bf16 weights are its fp32 masters rounded (fingerprinted too)
                    weights = block.to(torch.bfloat16)
                    bf16_position = model.write(weights, bf16_position)
                    summed.append(("module", weights))
                for key, values in summed if owned else ():
                    numel, total, total_sq = partial_sums(values)
                    entry = sums.setdefault((param.name, key), [0, 0.0, 0.0])
                    entry[0] += numel
                    entry[1] += total
                    entry[2] += total_sq
        if position != optim.offset(placeholders[state]) + placeholders[state].numel() * 4:
            raise RuntimeError(f"rank {rank} {state}: wrote {position} bytes into the partition's place")
    model.close()
    optim.close()


def fingerprints(plan: Plan, sums: dict[tuple[str, str], list[float]]) -> Fingerprints:
    """The resume fingerprints the engine records at save: per full tensor, from the ranks' owned parts."""
    result = Fingerprints(step=plan.steps, global_steps=plan.steps)
    for (name, state), (numel, total, total_sq) in sums.items():
        result.add(name, state, Fingerprint(int(numel), total, total_sq))
    return result


def write_checkpoint(plan: Plan, save_dir: Path, tag: str = "global_step1", *, log: bool = True,
                     sparse: bool = False) -> Path:
    """Write the checkpoint (both ranks) under ``save_dir/tag`` as deepspeed-ext's save does: built in its staging
    directory, committed by its marker, moved into place, ``latest`` last. Returns the tag directory. ``sparse``:
    the values are zeros the files hold as holes (:func:`write_rank`)."""
    import deepspeed
    import transformers

    import deepspeed_ext
    from deepspeed_ext.checkpoint import commit
    staging = commit.prepare_staging(save_dir, tag)
    tag_dir = staging / tag
    tag_dir.mkdir()
    sums: dict[tuple[str, str], list[float]] = {}
    for rank in range(plan.tp):
        start = time.perf_counter()
        write_rank(plan, tag_dir, rank, sums, sparse)
        if log:
            print(f"rank {rank}: {plan.rank_numel(rank) / 1e6:.0f}M elements in {time.perf_counter() - start:.0f} s",
                  flush=True)
    info = UCInfo(tp_size=plan.tp, layouts=plan.layouts, model_config=plan.config,
                  model_class=transformers.LlamaForCausalLM.__name__,
                  versions={"deepspeed_ext": deepspeed_ext.__version__, "deepspeed": deepspeed.__version__,
                            "torch": torch.__version__},
                  fingerprints=fingerprints(plan, sums), commit_marker=True,
                  frozen=[], engine_settings=engine_settings(plan))
    write_uc_info(tag_dir, info)
    # The engine copies DeepSpeed's recovery scripts beside the tags (the commit moves them out of the staging).
    utils = Path(deepspeed.__file__).parent / "utils"
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        if (utils / script).is_file():
            shutil.copyfile(utils / script, staging / script)
            os.chmod(staging / script, 0o744)
    details = {"global_steps": plan.steps, "world_size": plan.tp, "tp_degree": plan.tp, "zero_stage": 1,
               "written_by": dict(info.versions)}
    return commit.commit(save_dir, tag, details, save_latest=True)


def engine_settings(plan: Plan) -> dict[str, Any]:
    """What the engine records of the step it ran (``engine_private.step_settings``): the plan's config with
    DeepSpeed 0.19's defaults (clipping 1.0, one accumulation step) and the batch as the engine derives it: over
    the whole world, TP ranks included, as it counts ``global_samples``."""
    micro = plan.ds_config["train_micro_batch_size_per_gpu"]
    accum = plan.ds_config.get("gradient_accumulation_steps", 1)
    dtype = "bf16" if plan.ds_config.get("bf16", {}).get("enabled") else \
        "fp16" if plan.ds_config.get("fp16", {}).get("enabled") else "fp32"
    return {"gradient_clipping": float(plan.ds_config.get("gradient_clipping", 1.0)),
            "gradient_accumulation_steps": accum, "train_micro_batch_size_per_gpu": micro,
            "train_batch_size": micro * accum * plan.tp, "dtype": dtype}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--config", help="an HF config.json (a Llama) instead of --shapes")
    p.add_argument("--out", required=True, help="the save directory (gets TAG/, latest, DeepSpeed's scripts)")
    p.add_argument("--tag", default="global_step1")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparse", action="store_true", help="every value zero, as holes in the files (no disk)")
    args = p.parse_args(argv)
    config = json.loads(Path(args.config).read_text()) if args.config else llama_config_dict(SHAPES[args.shapes])
    plan = make_plan(config, tp=args.tp, seed=args.seed)
    out = Path(args.out)
    total = sum(p.layout.numel for p in plan.params)
    need = sum(plan.rank_numel(r) for r in range(plan.tp)) * (2 + 12)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path("/")).free
    print(f"{total / 1e9:.2f}B parameters; writing {need / 1e9:.1f} GB to {out} ({free / 1e9:.0f} GB free)", flush=True)
    if need > free and not args.sparse:
        raise SystemExit("not enough free disk")
    start = time.perf_counter()
    write_checkpoint(plan, out, args.tag, sparse=args.sparse)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
