"""Model features beyond the plain Llama: q/k/v biases (Qwen2), q/k norms + tied embeddings (Qwen3), mixtures
of experts (Qwen3-MoE, Mixtral), Gemma 3 (scaled tied embedding, sandwich norms, sliding/global layers) and
gpt-oss (attention sinks, biases everywhere, interleaved gate/up experts) and DeepSeek-V3 (MLA, dense then MoE
layers, shared experts, a router bias buffer).

Each family's TP=2 run is trained once: tests/conftest.py keeps a family's tests (its ``family`` parameter or mark)
on one worker, and they all ask for it through :func:`trained`."""

import json

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.families import maxtext_family_names
from harness.families import ONE_BY_ONE
from harness.hf import assert_to_hf_matches_live
from harness.runner import cli
from harness.scenario import (assert_losses_continue, assert_universal_matches_live, differences_from_upstream,
                              upstream_ds_to_universal)

#: Scenario names kept from before the per-family tests (other test files train the same runs under them).
SCENARIO_NAMES = {"qwen3": "qwen3_tied_tp2"}


def trained(scenarios, family: str):
    """The family's TP=2 ZeRO-1 bf16 run, trained once per run. Tests here name families as the registry does
    (``qwen3-moe``); the run is named and trained with the HF spelling (``qwen3_moe``), as other test files ask
    for the same runs."""
    family = family.replace("-", "_")
    return scenarios(SCENARIO_NAMES.get(family, f"{family}_tp2"), tp=2, family=family)



@pytest.mark.family("qwen2")
@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen2_qkv_biases_tp2_resumes(scenarios, target_tp):
    qwen2 = trained(scenarios, "qwen2")
    if target_tp == 1:
        assert_universal_matches_live(qwen2)
        bias = serialization.load(qwen2.universal_dir / "zero" / "model.layers.0.self_attn.k_proj.bias" / "fp32.pt")
        assert bias["param"].shape == (16, ) and bias["cat_dim"] == 0
    assert_losses_continue(qwen2, qwen2.resume(target_tp))


@pytest.fixture(scope="module")
def qwen3(scenarios):
    return trained(scenarios, "qwen3")


@pytest.mark.family("qwen3")
@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen3_tied_embeddings_tp2_resumes(qwen3, target_tp):
    if target_tp == 1:
        assert_universal_matches_live(qwen3)
    assert_losses_continue(qwen3, qwen3.resume(target_tp))


@pytest.mark.family("qwen3")
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
    return trained(scenarios, "qwen3-moe")


@pytest.mark.family("qwen3-moe")
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


@pytest.mark.family("qwen3-moe")
def test_qwen3_moe_universal_matches_live_engine_and_upstream(qwen3_moe, tmp_path):
    assert assert_universal_matches_live(qwen3_moe) == 25 * 3 * 2
    upstream = upstream_ds_to_universal(qwen3_moe.tag_dir, tmp_path / "upstream")
    assert differences_from_upstream(qwen3_moe.universal_dir, upstream) == []


@pytest.mark.family("qwen3-moe")
@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen3_moe_tp2_resumes(qwen3_moe, target_tp):
    assert_losses_continue(qwen3_moe, qwen3_moe.resume(target_tp))


#: Families trained with the partition preset deepspeed-ext ships for them (deepspeed_ext.tensor_parallel_preset),
#: and what AutoTP leaves whole on every TP rank, by name: (3-D stacks it cannot shard, weight matrices it does not
#: split), as initialize logs them.
_EXPERTS = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]
TRAINED_FAMILIES = {
    # AutoTP's defaults (transformers' tp_plan) split everything but the untied embedding.
    "mistral": ([], ["model.embed_tokens.weight"]),
    "llama3.1": ([], ["model.embed_tokens.weight"]),
    # MLA stays whole (see the preset in deepspeed_ext/checkpoint/families/deepseek_v3.py), and so do the router
    # and the fused experts; the dense MLPs, the shared experts and lm_head are split.
    "deepseek-v3": (_EXPERTS, ["model.embed_tokens.weight", "model.layers.*.self_attn.q_a_proj.weight",
                               "model.layers.*.self_attn.q_b_proj.weight",
                               "model.layers.*.self_attn.kv_a_proj_with_mqa.weight",
                               "model.layers.*.self_attn.kv_b_proj.weight", "model.layers.*.self_attn.o_proj.weight",
                               "model.layers.*.mlp.gate.weight"]),
    "mixtral": (_EXPERTS, ["model.embed_tokens.weight", "model.layers.*.mlp.gate.weight"]),
    "gemma3": ([], []),  # the tied embedding and head are vocabulary-parallel, everything else split
    # transformers gives gpt-oss no tp_plan but lm_head's, and its attention cannot be split by AutoTP without
    # splitting the per-head sinks (a 1-D parameter AutoTP does not touch): attention stays whole.
    "gpt-oss": (_EXPERTS, ["model.embed_tokens.weight", "model.layers.*.self_attn.q_proj.weight",
                           "model.layers.*.self_attn.k_proj.weight", "model.layers.*.self_attn.v_proj.weight",
                           "model.layers.*.self_attn.o_proj.weight", "model.layers.*.mlp.router.weight",
                           "model.layers.*.mlp.experts.gate_up_proj_bias",
                           "model.layers.*.mlp.experts.down_proj_bias"]),
}


@pytest.mark.parametrize("target_tp", [1, 3])
@pytest.mark.parametrize("family", list(TRAINED_FAMILIES))
def test_family_tp2_resumes(scenarios, family, target_tp):
    """DeepSpeed AutoTP TP=2 (bf16, ZeRO-1) -> to-universal -> resume at TP=1 and TP=3: the universal checkpoint
    holds what the live engine held, and the resumed losses are the uninterrupted run's within 2e-3."""
    scenario = trained(scenarios, family)
    if target_tp == 1:
        assert assert_universal_matches_live(scenario) > 0
    assert_losses_continue(scenario, scenario.resume(target_tp), rel=2e-3)


@pytest.mark.parametrize("family", list(TRAINED_FAMILIES))
def test_family_unsplit_layers_are_named(scenarios, family, tmp_path):
    """What AutoTP keeps whole is said by name at initialize and by ``inspect``, and held as replicated."""
    scenario = trained(scenarios, family)
    stacks, matrices = TRAINED_FAMILIES[family]
    log = (scenario.root / "train.log").read_text()
    for names, message in ((stacks, "AutoTP cannot shard"), (matrices, "AutoTP left")):
        lines = [line for line in log.splitlines() if message in line]
        assert (lines[0].endswith(": " + ", ".join(names)) if names else not lines), (message, lines)
    summary = json.loads(cli(["inspect", str(scenario.tag_dir), "--json"], tmp_path / "inspect.log").stdout)
    assert sorted(summary["unsharded_weights"]) == sorted(stacks + matrices)
    attention = "o_proj" if family == "deepseek-v3" else "q_proj"
    partition = summary["parameters"][f"model.layers.1.self_attn.{attention}.weight"]["partition_type"]
    assert partition == ("replicated" if family in ("gpt-oss", "deepseek-v3") else "column")


@pytest.mark.parametrize("family", list(TRAINED_FAMILIES))
def test_family_to_hf_matches_the_live_model(scenarios, tmp_path, caplog, family):
    assert_to_hf_matches_live(trained(scenarios, family), tmp_path, caplog)


#: The families whose DeepSpeed run MaxText's own training continues, and DeepSpeed MaxText's, in
#: tests/e2e/test_maxtext_continue_e2e.py (a DeepSpeed resume from from-maxtext's output at TP=1, 2 and 3).
CONTINUED_IN_MAXTEXT = ("mixtral", "deepseek-v3")


# Every family of the registry with a MaxText mapping but llama, whose round trip is
# tests/e2e/test_maxtext_continue_e2e.py's, the plain stacks llama stands for (their layers convert as llama's:
# tests/unit/test_maxtext.py round-trips each exactly), and the recent families, whose is
# test_recent_families_e2e.py's.
@pytest.mark.parametrize("family", [family for family in maxtext_family_names()
                                    if family not in ("llama", "llama3.1", "mistral", "qwen2") and family in ONE_BY_ONE])
def test_family_to_maxtext_and_back_resumes(scenarios, tmp_path, family):
    """Each family's DeepSpeed TP=2 run -> to-maxtext --with-optimizer (fp32, scanned, on a mesh) -> from-maxtext
    -> DeepSpeed resume at TP=1 continues the loss within 2e-3 (for the families of :data:`CONTINUED_IN_MAXTEXT`,
    resumed elsewhere, the round trip alone). The universal tensors come back exactly, but gemma3's norms, which
    MaxText stores as 1 + w (within the rounding of 1 + w)."""
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    tp2 = trained(scenarios, family)
    cli(["to-maxtext", str(tp2.save_dir), "-o", str(tmp_path / "maxtext"), "--dtype", "float32", "--with-optimizer",
         "--mesh", "fsdp=2,tensor=2,expert=2", "--quiet"], tmp_path / "to.log")
    back = tmp_path / "universal"
    cli(["from-maxtext", str(tmp_path / "maxtext"), "-o", str(back), "--quiet"], tmp_path / "from.log")
    original, returned = UniversalCheckpoint(tp2.universal_dir), UniversalCheckpoint(back)
    assert sorted(original.names) == sorted(returned.names)
    for name in original.names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            want, got = original.load(name, state), returned.load(name, state)
            if family == "gemma3" and name.endswith("norm.weight") and state == "fp32":
                assert (want - got).abs().max() <= 2**-23 * (1 + want.abs().max()), (name, state)
            else:
                assert torch.equal(want, got), (name, state)
        assert int(original.step(name)) == int(returned.step(name))
    if family not in CONTINUED_IN_MAXTEXT:  # those resume from MaxText's own training in test_maxtext_continue_e2e.py
        assert_losses_continue(tp2, tp2.resume(1, load_dir=back), rel=2e-3)
