"""Model features beyond the plain Llama: q/k/v biases (Qwen2), q/k norms + tied embeddings (Qwen3) and
a mixture of experts (Qwen3-MoE)."""

import json

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from harness.runner import cli
from harness.scenario import (assert_losses_continue, assert_universal_matches_live, differences_from_upstream,
                              upstream_ds_to_universal)


@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen2_qkv_biases_tp2_resumes(scenarios, target_tp):
    qwen2 = scenarios("qwen2_tp2", tp=2, family="qwen2")
    if target_tp == 1:
        assert_universal_matches_live(qwen2)
        bias = serialization.load(qwen2.universal_dir / "zero" / "model.layers.0.self_attn.k_proj.bias" / "fp32.pt")
        assert bias["param"].shape == (16, ) and bias["cat_dim"] == 0
    assert_losses_continue(qwen2, qwen2.resume(target_tp))


@pytest.fixture(scope="module")
def qwen3(scenarios):
    return scenarios("qwen3_tied_tp2", tp=2, family="qwen3")


@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen3_tied_embeddings_tp2_resumes(qwen3, target_tp):
    if target_tp == 1:
        assert_universal_matches_live(qwen3)
    assert_losses_continue(qwen3, qwen3.resume(target_tp))


def test_tied_embedding_is_held_in_full_where_upstream_writes_a_shard(qwen3, tmp_path):
    """Disagreement with upstream 0.19.8, named: parameter ``lm_head.weight`` of a tied Qwen3 at TP=2.

    Upstream writes ``zero/lm_head.weight`` as one rank's [51, 64] vocab shard that no model can load as
    lm_head. We are right: the tie makes lm_head *be* ``model.embed_tokens.weight``, which we hold in
    full ([101, 64], bit-identical to upstream's own embedding) and which restores both ends of the tie.
    """
    ours = qwen3.universal_dir / "zero"
    assert not (ours / "lm_head.weight").exists()
    embed = serialization.load(ours / "model.embed_tokens.weight" / "fp32.pt")["param"]
    assert embed.shape == (101, 64)

    upstream = upstream_ds_to_universal(qwen3.tag_dir, tmp_path / "upstream")
    assert torch.equal(serialization.load(upstream / "zero" / "model.embed_tokens.weight" / "fp32.pt")["param"],
                       embed)
    lm_head = serialization.load(upstream / "zero" / "lm_head.weight" / "fp32.pt")["param"]
    assert lm_head.shape == (51, 64), "upstream now writes lm_head differently: update this test and the docs"
    assert not torch.equal(lm_head, embed[:51])  # a bf16-rounded shard, not even the tied rows' fp32 values


@pytest.fixture(scope="module")
def qwen3_moe(scenarios):
    return scenarios("qwen3_moe_tp2", tp=2, family="qwen3_moe")


def test_qwen3_moe_unshardable_experts_are_reported_by_name(qwen3_moe, tmp_path):
    """transformers keeps a layer's experts as fused 3-D parameters, which AutoTP (nn.Linear only) cannot
    shard: they stay whole on every TP rank. That is said by name at initialize and by ``inspect``, and
    the converter holds them as replicated (the TP ranks' copies must agree), never as a slice."""
    log = (qwen3_moe.root / "train.log").read_text()
    assert "AutoTP cannot shard 4 parameters" in log
    assert "model.layers.*.mlp.experts.gate_up_proj, model.layers.*.mlp.experts.down_proj" in log
    summary = json.loads(cli(["inspect", str(qwen3_moe.tag_dir), "--json"], tmp_path / "inspect.log").stdout)
    assert summary["unsharded_weights"] == [
        "model.embed_tokens.weight", "model.layers.*.mlp.experts.gate_up_proj",
        "model.layers.*.mlp.experts.down_proj", "model.layers.*.mlp.gate.weight"
    ]
    experts = summary["parameters"]["model.layers.1.mlp.experts.gate_up_proj"]
    assert experts["partition_type"] == "replicated" and experts["shape"] == [4, 96, 64]
    sharded = summary["parameters"]["model.layers.1.self_attn.q_proj.weight"]
    assert sharded["partition_type"] == "column"


def test_qwen3_moe_universal_matches_live_engine_and_upstream(qwen3_moe, tmp_path):
    assert assert_universal_matches_live(qwen3_moe) == 25 * 3 * 2
    upstream = upstream_ds_to_universal(qwen3_moe.tag_dir, tmp_path / "upstream")
    assert differences_from_upstream(qwen3_moe.universal_dir, upstream) == []


@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen3_moe_tp2_resumes(qwen3_moe, target_tp):
    assert_losses_continue(qwen3_moe, qwen3_moe.resume(target_tp))
