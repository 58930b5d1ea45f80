"""peft LoRA under DeepSpeed AutoTP through deepspeed_ext.initialize (the tiny Llama, 4 KV heads, LoRA r=4 on every
linear layer): a TP=2 adapter run trains as the run without TP does; its adapters are cut as their base layers are
(lora_B's rows under a column-parallel layer, lora_A's columns under a row-parallel one) and recorded so; it
resumes at TP=1 and TP=3 (uneven: 2-1-1 KV heads) with every state exact, from the universal form and directly;
its PEFT and merged exports have the live model's logits. DoRA under AutoTP is refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness.adapters import live_logits, logits, merged_loaded, peft_loaded
from harness.runner import cli, run_logged, torchrun_train
from harness.scenario import Load, assert_universal_matches_live

TP2 = dict(tp=2, dp=1, zero=1, dtype="fp32", lora=4)
LOGITS_ATOL = 1e-5
LOSS_RTOL = 2e-3


@pytest.fixture(scope="module")
def tp2(scenarios):
    return scenarios("lora_llama_tp2", **TP2)


def close(resumed: dict[int, float], baseline: dict[int, float]) -> bool:
    return bool(resumed) and all(abs(loss - baseline[step]) <= LOSS_RTOL * abs(baseline[step])
                                 for step, loss in resumed.items())


def assert_shards_make(full: torch.Tensor, shards: list[torch.Tensor], where: str) -> None:
    """``shards`` (one per TP rank) are ``full`` cut along one dimension in rank order, or each ``full`` itself."""
    split = [d for d in range(full.dim()) if any(shard.shape[d] != full.shape[d] for shard in shards)]
    if not split:
        assert all(torch.equal(shard, full) for shard in shards), where
        return
    assert len(split) == 1, (where, full.shape, [shard.shape for shard in shards])
    assert torch.equal(torch.cat(shards, dim=split[0]), full), where


def test_a_tp2_adapter_run_trains_as_the_run_without_tp(tp2, scenarios):
    """The same losses as the TP=1 run (DP=2, the same global batch), within fp32 rounding."""
    without_tp = scenarios("lora_llama_zero1", zero=1, tp=1, dp=2, dtype="fp32", lora=4)
    assert close(tp2.baseline, without_tp.baseline), (tp2.baseline, without_tp.baseline)


def test_adapters_are_cut_as_their_base_layers_and_recorded_so(tp2, tmp_path):
    """Column-parallel q_proj: lora_B split by rows as its weight, lora_A whole; row-parallel o_proj: lora_A split by
    columns, lora_B whole. The universal form holds every live shard, bit for bit."""
    summary = json.loads(cli(["inspect", str(tp2.tag_dir), "--json"], tmp_path / "inspect.log").stdout)
    layouts = summary["parameters"]
    attention = "base_model.model.model.layers.0.self_attn"

    def split(name: str) -> tuple:
        layout = layouts[f"{attention}.{name}"]
        return layout["shape"], layout["partition_dim"], layout.get("shard_widths")

    assert split("q_proj.lora_B.default.weight") == ([64, 4], 0, [[32, 32]])
    assert split("q_proj.lora_A.default.weight") == ([4, 64], None, None)
    assert split("o_proj.lora_A.default.weight") == ([4, 64], 1, [[32, 32]])
    assert split("o_proj.lora_B.default.weight") == ([64, 4], None, None)
    assert not any("lora" in name for name in summary["unsharded_weights"]), summary["unsharded_weights"]
    assert assert_universal_matches_live(tp2) > 0


def test_a_tp2_adapter_run_resumes_at_tp1_and_tp3_from_both_forms(tp2):
    """Right after each load, every TP rank's adapters, Adam moments and frozen base weights are the universal
    tensors cut for its rank, bit for bit; the next loss is the uninterrupted run's."""
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    universal = UniversalCheckpoint(tp2.universal_dir)
    loads = [Load(tp, 1, source, load_universal=source == tp2.universal_dir)
             for tp in (1, 3) for source in (tp2.universal_dir, tp2.tag_dir)]
    for (ranks, losses), load in zip(tp2.loaded_many(loads), loads, strict=True):
        assert len(ranks) == load.tp and sorted(ranks[0]) == sorted(universal.names), load
        assert any(".lora_B." in name for name in ranks[0])
        for name, states in ranks[0].items():
            for state in states:
                assert_shards_make(universal.load(name, state), [rank[name][state] for rank in ranks],
                                   f"{load}: {name}/{state}")
        assert sorted(losses) == [tp2.save_at + 1] and close(losses, tp2.baseline), (load, losses, tp2.baseline)


def test_tp2_adapter_exports_have_the_live_logits(tp2, tmp_path):
    live = live_logits(tp2)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    cli(["to-hf", str(tp2.tag_dir), "-o", str(adapter), "-q"], tmp_path / "adapter.log")
    assert (logits(peft_loaded(tp2, adapter)) - live).abs().max().item() <= LOGITS_ATOL
    cli(["to-hf", str(tp2.universal_dir), "-o", str(merged), "--merge", "-q"], tmp_path / "merged.log")
    assert (logits(merged_loaded(merged)) - live).abs().max().item() <= LOGITS_ATOL


def test_with_lora_dropout_the_whole_factors_stay_equal_on_every_tp_rank(tmp_path):
    """Each TP rank draws its own dropout mask; lora_A above a column-parallel layer (and lora_B below a row-parallel
    one) still gets one gradient, so the two ranks' copies never part. ZeRO-2, two adapters' worth of steps."""
    save = tmp_path / "ckpt"
    torchrun_train(2, ["--tp", "2", "--zero", "2", "--dtype", "fp32", "--steps", "3", "--lora", "4",
                       "--lora-options", json.dumps({"lora_dropout": 0.2}), "--save-dir", str(save), "--save-at", "3"],
                   tmp_path / "train.log")
    from deepspeed_ext.checkpoint import serialization
    ranks = [serialization.load(save / "global_step3" / f"mp_rank_{r:02d}_model_states.pt")["module"]
             for r in range(2)]
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    whole = [name for name in ranks[0] if (".lora_A." in name and name.split(".")[-4] in column)
             or (".lora_B." in name and name.split(".")[-4] in ("o_proj", "down_proj"))]
    assert len(whole) == 14, whole
    for name in whole:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    moved = [name for name in whole if "lora_A" in name]
    assert moved and all(ranks[0][name].abs().sum() > 0 for name in moved)


def test_dora_under_autotp_is_refused_in_one_line(tmp_path):
    proc = torchrun_train(2, ["--tp", "2", "--zero", "1", "--dtype", "fp32", "--steps", "1", "--lora", "4",
                              "--lora-options", json.dumps({"use_dora": True})], tmp_path / "dora.log", check=False)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "use a LoRA variant (DoRA" in line]
    assert lines and "use_dora=False" in lines[0], proc.stderr[-2000:]


def test_qwen3_tp2_adapters_with_frozen_grad_allreduce_norms_and_a_vocab_parallel_head(scenarios):
    """Qwen3 (tied vocab-parallel embedding and head; q/k norms AutoTP gives a gradient all-reduce, frozen here) at
    TP=2 ZeRO-2 trains as at TP=1 and resumes at TP=1 from its universal form with the uninterrupted losses."""
    settings = dict(family="qwen3", zero=2, dtype="fp32", lora=4)
    tp2 = scenarios("lora_qwen3_tp2", tp=2, **settings)
    tp1 = scenarios("lora_qwen3_tp1", tp=1, convert=False, **settings)
    assert close(tp2.baseline, tp1.baseline), (tp2.baseline, tp1.baseline)
    resumed = tp2.resume(1, 1)
    assert sorted(resumed) == [4, 5] and close(resumed, tp2.baseline), (resumed, tp2.baseline)


def test_the_gradient_norm_counts_cut_adapters_on_every_rank_and_whole_ones_once(tmp_path):
    """The global gradient norm DeepSpeed clips with is the TP=1 run's at every step (ZeRO-1 and ZeRO-3): the cut
    adapters' shares are summed over the TP ranks and the whole factors counted once, as for AutoTP's own weights."""
    norms = {}
    for tp, zero in ((1, 1), (2, 1), (2, 3)):
        result = tmp_path / f"tp{tp}_zero{zero}.json"
        torchrun_train(tp, ["--tp", str(tp), "--zero", str(zero), "--dtype", "fp32", "--steps", "2", "--lora", "4",
                            "--record-grad-norms", "--result", str(result)], tmp_path / f"tp{tp}_zero{zero}.log")
        norms[(tp, zero)] = json.loads(result.read_text())["grad_norms"]
    expected = norms[(1, 1)]
    assert len(expected) == 2 and all(value > 0 for value in expected.values()), expected
    for key, found in norms.items():
        assert all(abs(found[step] - value) <= 1e-5 * value for step, value in expected.items()), (key, norms)


def test_a_frozen_adapter_a_second_engine_and_a_mixed_batch(tmp_path):
    """A second adapter left frozen (with dropout) initializes; a second engine on the same model keeps the cut
    adapters as they are and trains; peft's adapter_names= is refused in one line."""
    worker = Path(__file__).resolve().parents[1] / "harness" / "workers" / "lora_autotp_edges.py"
    result = tmp_path / "edges.json"
    run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
                str(result)], tmp_path / "edges.log")
    seen = json.loads(result.read_text())
    assert seen["lora_B_rows_1"] == seen["lora_B_rows_2"] == 32, seen  # q_proj's 64 rows over 2 ranks, cut once
    assert seen["loss_2"] < seen["loss_1"], seen
    assert seen["mixed_batch"].startswith("UnsupportedGeometryError") and "adapter_names" in seen["mixed_batch"]
