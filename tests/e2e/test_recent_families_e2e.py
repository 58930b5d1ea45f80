"""Every family of the registry without test files of its own (2025-26's: Qwen3.5, Qwen3-Next, Gemma 4,
DeepSeek-V3.2, GLM-5, Llama 4, OLMo 3, GLM-4.5, MiniMax-M2, and any family added after them), on every path at once:
train with its AutoTP preset at TP=2 (fp32, ZeRO-1) -> to-universal -> resume at TP=1 and TP=3 from the universal
form and straight from the checkpoint -> to-hf (transformers' logits) -> from-hf -> DeepSpeed; to-maxtext where
deepspeed-ext maps the family to MaxText, else its one-line refusal.

The family list comes from the registry, so a new family is tested here without a test naming it. A family's tests
share its two trained runs (TP=2 and TP=1) and stay on one pytest-xdist worker (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.checkpoint.families import get_family
from harness.families import RECENT
from harness.hf import assert_to_hf_matches_live, cli
from harness.scenario import Load, assert_universal_matches_live
#: Those DeepSpeed's AutoEP runs (deepspeed_ext.expert_parallel_preset), one per distinct way in: the AutoEP section
#: and the names AutoEP gives the block (families alike in both run the same code; CI's minutes go elsewhere).
_AUTOEP_WAYS: dict[tuple[str, tuple], str] = {}
for _family in RECENT:
    if get_family(_family).expert_parallel is not None:
        _AUTOEP_WAYS.setdefault((repr(get_family(_family).expert_parallel), get_family(_family).autoep_renamed), _family)
AUTOEP = list(_AUTOEP_WAYS.values())


def trained(scenarios, family: str, tp: int = 2):
    """The family's fp32 ZeRO-1 run at ``tp`` (5 steps, saved after step 3; TP=1, the reference, 3 steps), trained
    once per test run."""
    steps = 5 if tp != 1 else 3
    return scenarios(f"recent_{family}_tp{tp}", tp=tp, family=family, dtype="fp32", convert=tp != 1, steps=steps)


@pytest.mark.parametrize("family", RECENT)
def test_tp2_trains_as_tp1_and_converts_what_the_engine_held(scenarios, family):
    """The preset splits without losing a gradient's sum: TP=2's losses are TP=1's within 1e-5 over the first 3
    steps (fp32); the universal checkpoint holds what the live TP=2 engine held, every state of every parameter."""
    split, whole = trained(scenarios, family), trained(scenarios, family, tp=1)
    for step in (1, 2, 3):
        assert abs(split.baseline[step] - whole.baseline[step]) <= 1e-5 * abs(whole.baseline[step]), (
            step, split.baseline, whole.baseline)
    assert assert_universal_matches_live(split) > 0
    # Gated-DeltaNet linear attention (Qwen3.5, Qwen3-Next) is split by heads, all but the norm shared by the heads.
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    layouts = DeepSpeedCheckpoint(split.save_dir).layouts
    deltanet = {name: layout for name, layout in layouts.items() if ".linear_attn." in name}
    assert all(layout.is_replicated == name.endswith(".norm.weight") for name, layout in deltanet.items()), deltanet
    if deltanet:  # the convolution's q, k and v channels, each split
        from deepspeed_ext.demo.models import tiny_config
        config = tiny_config(family)
        key, value = (config.linear_num_key_heads * config.linear_key_head_dim,
                      config.linear_num_value_heads * config.linear_value_head_dim)
        assert layouts["model.layers.0.linear_attn.conv1d.weight"].sub_param_sizes == (key, key, value)


@pytest.mark.parametrize("family", RECENT)
def test_resumes_at_tp1_and_tp3_from_universal_and_directly(scenarios, family):
    """Resumed at TP=1 from the universal form and straight from the TP=2 checkpoint (one state, bit for bit), and
    at TP=3: the next losses are the uninterrupted run's (fp32: within 1e-4)."""
    split = trained(scenarios, family)
    (universal, universal_losses), (direct, direct_losses), (_, tp3_losses) = split.loaded_many(
        [Load(1, 1, split.universal_dir), Load(1, 1, split.tag_dir, load_universal=False),
         Load(3, 1, split.universal_dir)])
    step = split.save_at + 1
    for label, losses in (("universal", universal_losses), ("direct", direct_losses), ("TP=3", tp3_losses)):
        assert abs(losses[step] - split.baseline[step]) <= 1e-4 * abs(split.baseline[step]), (label, losses)
    for name, states in universal[0].items():
        for state, value in states.items():
            assert torch.equal(direct[0][name][state], value), f"{name}/{state}"


@pytest.mark.parametrize("family", RECENT)
def test_to_hf_gives_the_live_logits_and_from_hf_loads_them_back(scenarios, tmp_path, caplog, family):
    """to-hf straight from the TP=2 checkpoint: transformers loads it without complaint and gives the live TP
    engine's logits; from-hf of that output, loaded by DeepSpeed at TP=2, puts back every rank's weights."""
    split = trained(scenarios, family)
    assert_to_hf_matches_live(split, tmp_path, caplog)
    cli("from-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "from_hf"))
    (loaded, _), = split.loaded_many([Load(2, 1, tmp_path / "from_hf", extra=("--steps", "1"))])
    live = split.live_state()
    for rank in range(2):
        for name, states in live[rank].items():
            assert torch.equal(loaded[rank][name]["fp32"], states["fp32"]), (rank, name)


@pytest.mark.parametrize("family", RECENT)
def test_to_maxtext_and_back_resumes_or_refuses_in_one_line(scenarios, tmp_path, capsys, family):
    """A family with a MaxText mapping: the TP=2 run -> to-maxtext --with-optimizer (fp32, scanned where the layer
    count allows, on a mesh) -> from-maxtext gives back every universal tensor and step exactly, and DeepSpeed
    resumes from it at TP=1 (next loss within 1e-4); MaxText's own model code reads such output in
    test_maxtext_model_code.py. A family without one is refused in one line saying why and naming the families
    that have one; nothing is written."""
    from deepspeed_ext.checkpoint.families import maxtext_family_names
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    from deepspeed_ext.cli import main
    from deepspeed_ext.demo.models import tiny_config
    from deepspeed_ext.errors import CheckpointError
    split = trained(scenarios, family)
    out = tmp_path / "maxtext"
    if not get_family(family).maxtext_model:
        capsys.readouterr()
        assert main(["to-maxtext", str(split.save_dir), "-o", str(out), "--quiet"]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"family {family} has no MaxText mapping (MaxText 0.2.5 has" in error[0], error
        assert ", ".join(maxtext_family_names()) in error[0]
        assert not out.exists()
        return
    try:
        get_family(family).layer_blocks(tiny_config(family).to_dict(), True)
        scan = "--scan-layers"
    except CheckpointError:  # a depth scanned MaxText cannot hold: unscanned (test_maxtext.py checks the refusal)
        scan = "--no-scan-layers"
    cli("to-maxtext", str(split.save_dir), "-o", str(out), "--dtype", "float32", "--with-optimizer", scan,
        "--mesh", "fsdp=2,tensor=2")
    cli("from-maxtext", str(out), "-o", str(tmp_path / "back"))
    original, returned = UniversalCheckpoint(split.universal_dir), UniversalCheckpoint(tmp_path / "back")
    assert sorted(original.names) == sorted(returned.names)
    for name in original.names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(original.load(name, state), returned.load(name, state)), (name, state)
        assert int(original.step(name)) == int(returned.step(name))
    (_, losses), = split.loaded_many([Load(1, 1, tmp_path / "back")])
    step = split.save_at + 1
    assert abs(losses[step] - split.baseline[step]) <= 1e-4 * abs(split.baseline[step]), (losses, split.baseline)


@pytest.mark.parametrize("family", AUTOEP)
def test_autoep_ep2_resumes_at_ep1_and_goes_to_hf(scenarios, tmp_path, family):
    """AutoEP at EP=2 (DP=2, fp32) with the family's preset trains the model transformers' own MoE block trains (the
    TP=1 run's losses within 1e-5 over 3 steps: the preset routes as the model does) -> resumed at EP=1 from the
    universal form: the next loss is the uninterrupted run's (1e-4); to-hf under transformers' names loads with
    nothing missing and gives the AutoEP engine's logits."""
    from transformers import AutoModelForCausalLM

    from deepspeed_ext.demo.models import eval_batch
    ep2 = scenarios(f"recent_{family}_ep2", tp=1, dp=2, ep=2, family=family, dtype="fp32", steps=4)
    whole = trained(scenarios, family, tp=1)
    for step in (1, 2, 3):
        assert abs(ep2.baseline[step] - whole.baseline[step]) <= 1e-5 * abs(whole.baseline[step]), (
            step, ep2.baseline, whole.baseline)
    (_, losses), = ep2.loaded_many([Load(1, 1, ep2.save_dir, extra=("--ep", "1"))])
    step = ep2.save_at + 1
    assert abs(losses[step] - ep2.baseline[step]) <= 1e-4 * abs(ep2.baseline[step]), (losses, ep2.baseline)
    cli("to-hf", str(ep2.save_dir), "-o", str(tmp_path / "hf"))
    model, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                          attn_implementation="eager")
    assert not any(loading.values()), loading
    with torch.no_grad():
        logits = model(input_ids=eval_batch()).logits.float()
    live = torch.load(ep2.dump_dir / "logits_tp_rank_00.pt", weights_only=True)
    assert (logits - live).abs().max() <= 1e-4, (logits - live).abs().max()
