"""Fewer KV heads than TP ranks: a legal DeepSpeed geometry where the ranks beyond the head count hold empty
attention shards (q/k/v rows and o_proj columns of width 0).

The tiny models here have 2 KV heads, so TP=3 and TP=4 have such ranks and TP=2 has none. Every path is run on
the real engine: conversion from a checkpoint saved with empty shards, restore into an engine with empty shards
(from the universal form and by direct load), ZeRO-1/2/3 on either side, a Llama-style model and a tied-embedding
Qwen3-style model, and the bridges to HF and MaxText. DeepSpeed's ZeRO-3 cannot train this geometry at all; that
is refused in one line before the first step.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.runner import child_env, cli, zygote_workers
from harness.scenario import (KV2_SCENARIOS, Load, assert_losses_continue, assert_universal_matches_live,
                              without_recorded_order)


#: The uninterrupted run's losses, continued within this relative difference.
REL = 2e-3


def kv2(scenarios, name: str):
    return scenarios(name, **KV2_SCENARIOS[name])


@pytest.mark.parametrize("name", ["kv2_llama_tp3", "kv2_qwen3_tp3", "kv2_llama_tp3_zero0", "kv2_llama_tp2_zero3"])
def test_merged_state_equals_the_live_engine(scenarios, name):
    """TP=3 (rank 2 holds empty attention shards; ZeRO-1, and without ZeRO) and a ZeRO-3 TP=2 source: every merged
    fp32 / exp_avg / exp_avg_sq, cut back into the saved TP slices, equals what each live rank held, bit for bit."""
    scenario = kv2(scenarios, name)
    # DeepSpeed's stage-0 bf16 wrapper takes one zero-gradient Adam step when it is built.
    steps = scenario.save_at + 1 if scenario.zero == 0 else scenario.save_at
    assert assert_universal_matches_live(scenario, steps) == len(scenario.live_state()[0]) * 3 * scenario.tp


# (scenario, target TP, target ZeRO stage or None for the saved one, load the DeepSpeed checkpoint directly).
# With test_direct_load_equals_loading_the_universal_form (Llama 3 -> 4, Qwen3 2 -> 3, both ways), every move
# between TP 2, 3 and 4 is covered for both models, ZeRO-1 and ZeRO-3 on either side, universal and direct.
RESUMES = [
    ("kv2_llama_tp2", 3, None, False),  # 2 -> 3: the target's rank 2 is empty
    ("kv2_llama_tp2", 4, None, True),  # 2 -> 4: ranks 2 and 3 empty, straight from the DeepSpeed checkpoint
    ("kv2_llama_tp3", 2, None, False),  # 3 -> 2: the source's rank 2 saved nothing for attention
    ("kv2_llama_tp3", 2, 3, False),  # into ZeRO-3, which restores through deepspeed-ext too
    ("kv2_llama_tp3", 2, 3, True),
    ("kv2_qwen3_tp2", 4, None, False),
    ("kv2_qwen3_tp3", 2, None, True),
    ("kv2_qwen3_tp3", 2, 3, False),
    ("kv2_llama_tp2_zero3", 3, 1, True),  # a ZeRO-3 source into ZeRO-1 ranks with empty shards
    ("kv2_llama_tp3_zero0", 4, None, False),  # without ZeRO on both sides
    ("kv2_llama_tp4", 3, None, True),  # 3 layers, head_dim 8 at TP=4 (two empty ranks) -> TP=3 (one)
]


@pytest.mark.parametrize("name, tp, zero, direct", RESUMES,
                         ids=[f"{n}-to-tp{tp}" + (f"-zero{z}" if z else "") + ("-direct" if d else "-universal")
                              for n, tp, z, d in RESUMES])
def test_resumes_where_some_ranks_hold_no_attention_shard(scenarios, name, tp, zero, direct):
    scenario = kv2(scenarios, name)
    resumed = scenario.resume(tp, load_dir=scenario.tag_dir if direct else None, zero=zero)
    assert_losses_continue(scenario, resumed, rel=REL)


@pytest.mark.parametrize("name, tp", [("kv2_llama_tp3", 4), ("kv2_qwen3_tp2", 3)])
def test_direct_load_equals_loading_the_universal_form(scenarios, name, tp):
    """Every rank's weights and Adam state right after load_checkpoint, empty shards included, are the same bits
    whether it read the original checkpoint or its universal form; the next loss continues the saved run."""
    scenario = kv2(scenarios, name)
    (direct, direct_losses), (converted, converted_losses) = scenario.loaded_many(
        [Load(tp, 1, scenario.tag_dir), Load(tp, 1, scenario.universal_dir)])
    empty = 0
    for rank in range(tp):
        assert sorted(direct[rank]) == sorted(converted[rank])
        for param, states in converted[rank].items():
            for state, expected in states.items():
                assert torch.equal(direct[rank][param][state], expected), f"TP rank {rank}: {param}/{state}"
            empty += states["fp32"].numel() == 0
    assert empty > 0  # the geometry really has empty shards
    assert direct_losses == converted_losses
    step = scenario.save_at + 1
    assert abs(direct_losses[step] - scenario.baseline[step]) <= REL * abs(scenario.baseline[step])


def test_without_zero_the_parameter_order_is_recovered_per_rank(scenarios, tmp_path):
    """Without ZeRO the optimizer state names no parameter, and a rank with empty shards holds fewer entries than
    rank 0 (DeepSpeed leaves empty parameters out). The order recorded on rank 0 and the order recovered from a
    rank's module state dict both skip them, and give the same tensors."""
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    scenario = kv2(scenarios, "kv2_llama_tp3_zero0")
    copy = without_recorded_order(scenario.tag_dir, tmp_path / scenario.tag_dir.name)
    recorded, derived = DeepSpeedCheckpoint(scenario.tag_dir), DeepSpeedCheckpoint(copy)
    assert list(derived.layouts) == list(recorded.layouts)
    for name in recorded.layouts:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(derived.full_tensor(name, state), recorded.full_tensor(name, state)), (name, state)


def test_zero3_with_empty_shards_is_refused_in_one_line_before_training(tmp_path):
    """DeepSpeed's ZeRO-3 fails at the first forward pass when a TP rank holds an empty parameter; deepspeed-ext
    says so at initialize, naming the parameter and the shard sizes."""
    log = tmp_path / "train.log"
    command, env = zygote_workers(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m",
         "deepspeed_ext.demo.train", "--tp", "3", "--zero", "3", "--kv-heads", "2", "--steps", "2", "--result",
         str(tmp_path / "result.json")], child_env())
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode != 0 and not (tmp_path / "result.json").exists()
    errors = sorted({line.split("UnsupportedGeometryError: ", 1)[1] for line in proc.stderr.splitlines()
                     if "UnsupportedGeometryError: " in line})
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "ZeRO-3 cannot train at autotp_size=3" in errors[0]
    assert "'model.layers.0.self_attn.q_proj.weight'" in errors[0] and "shards [32, 32, 0]" in errors[0]
    assert "AssertionError" not in proc.stderr  # DeepSpeed's own failure never came


def test_maxtext_round_trip_from_a_checkpoint_with_empty_shards(scenarios, tmp_path):
    """DeepSpeed TP=3 (empty shards) -> to-maxtext --with-optimizer -> from-maxtext: the same universal files,
    bit for bit, as converting the DeepSpeed checkpoint directly."""
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    scenario = kv2(scenarios, "kv2_llama_tp3")
    maxtext, back = tmp_path / "maxtext", tmp_path / "back"
    cli(["to-maxtext", str(scenario.save_dir), "-o", str(maxtext), "--dtype", "float32", "--with-optimizer", "-q"],
        tmp_path / "to.log")
    assert "0 problem(s)" in cli(["verify", str(maxtext)], tmp_path / "verify.log").stdout
    cli(["from-maxtext", str(maxtext), "-o", str(back), "-q"], tmp_path / "from.log")
    original, returned = UniversalCheckpoint(scenario.universal_dir), UniversalCheckpoint(back)
    assert sorted(original.names) == sorted(returned.names)
    for name in original.names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(original.load(name, state), returned.load(name, state)), (name, state)
