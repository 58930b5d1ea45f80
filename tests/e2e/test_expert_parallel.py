"""DeepSpeed AutoEP (expert parallelism) checkpoints on the real engine: Mixtral, Qwen3-MoE and DeepSeek-V3 trained
with ``"expert_parallel": {"autoep_size": N}`` (CPU, gloo), converted and resumed at other EP and ZeRO degrees,
directly and through the universal form, and interchanged with upstream's own ``ds_to_universal`` both ways."""

import json
from pathlib import Path

import pytest
import torch

from harness.runner import cli
from harness.scenario import Load, Scenario, upstream_ds_to_universal

#: The resumed loss within this of the uninterrupted run's (relative): other EP and DP degrees sum the same
#: gradients in another order.
TOLERANCE = 2e-3
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def ep2(scenarios) -> Scenario:
    """Mixtral (4 experts) at EP=2 over 2 ranks, ZeRO-1 bf16: each rank holds 2 experts."""
    return scenarios("autoep_mixtral_ep2_zero1", tp=1, dp=2, ep=2, family="mixtral")


@pytest.fixture(scope="module")
def ep1_zero3(scenarios) -> Scenario:
    """Mixtral at EP=1 over 2 ranks, ZeRO-3: every rank holds every expert, ZeRO-3 partitions them."""
    return scenarios("autoep_mixtral_ep1_zero3", tp=1, dp=2, ep=1, zero=3, family="mixtral")


def _assert_continues(scenario: Scenario, losses: dict[int, float], what: str) -> None:
    assert losses, what
    for step, loss in losses.items():
        base = scenario.baseline[step]
        assert abs(loss - base) <= TOLERANCE * abs(base), f"{what}: step {step} loss {loss}, uninterrupted {base}"


def _universal_save_dir(universal: Path, root: Path, name: str) -> Path:
    """A save directory whose ``latest_universal`` names ``universal`` (linked in), as a resume loads it."""
    save = root / name
    save.mkdir()
    (save / universal.name).symlink_to(universal.resolve())
    (save / "latest_universal").write_text(universal.name)
    return save


def test_inspect_shows_the_expert_parallel_layout(ep2, tmp_path):
    proc = cli(["inspect", str(ep2.save_dir), "--json"], tmp_path / "inspect.log")
    summary = json.loads(proc.stdout)
    experts = summary["expert_parallel"]
    assert experts["ep_degree"] == 2 and experts["experts_per_rank"] == 2 and experts["moe_layers"] == 2
    assert experts["placement"] == {"ep_rank 0": "0..1", "ep_rank 1": "2..3"}
    w1 = summary["parameters"]["model.layers.0.mlp.experts.w1"]
    assert (w1["shape"], w1["role"], w1["shard_widths"]) == ([4, 160, 64], "experts", [[2, 2]])


def test_merged_experts_equal_the_live_engine_and_upstreams_conversion(ep2, tmp_path):
    """Every EP rank's experts, cut from our merged [experts, ...] tensors, equal what DeepSpeed itself reports
    (fp32 masters and both Adam moments, bit for bit), and so does every tensor upstream's converter writes."""
    from deepspeed_ext.checkpoint import serialization
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint

    layouts = DeepSpeedCheckpoint(ep2.tag_dir).layouts
    experts = {name: layout for name, layout in layouts.items() if layout.role == "experts"}
    assert len(experts) == 6  # w1, w2, w3 of 2 MoE layers
    live = ep2.live_experts()
    assert sorted(live) == [0, 1]
    compared = 0
    for name, layout in experts.items():
        assert layout.shape[0] == 4 and layout.tp_size == 2
        for state in STATES:
            entry = serialization.load(ep2.universal_dir / "zero" / name / f"{state}.pt")
            assert entry["is_expert_param"] is True and entry["ep_num_experts"] == 4 and entry["cat_dim"] == 0
            for ep_rank in (0, 1):
                assert torch.equal(layout.slice(entry["param"], ep_rank), live[ep_rank][name][state]), \
                    f"{name}/{state}: EP rank {ep_rank} differs from the live engine"
                compared += 1
    assert compared == 36
    dense = ep2.live_state()[0]
    for name in (n for n in layouts if n not in experts):
        for state in STATES:
            entry = serialization.load(ep2.universal_dir / "zero" / name / f"{state}.pt")
            assert torch.equal(entry["param"], dense[name][state]), f"{name}/{state}"

    upstream = upstream_ds_to_universal(ep2.tag_dir, tmp_path / "upstream_universal")
    for name in layouts:
        for state in (*STATES, "step"):
            ours = serialization.load(ep2.universal_dir / "zero" / name / f"{state}.pt")
            theirs = serialization.load(upstream / "zero" / name / f"{state}.pt")
            if state == "step":
                assert float(ours) == float(theirs) == ep2.save_at
                continue
            assert torch.equal(ours["param"], theirs["param"]), f"{name}/{state} differs from upstream's"
            for key in ("is_expert_param", "ep_num_experts"):
                assert ours.get(key) == theirs.get(key), (name, state, key)


def test_ep2_resumes_at_ep1_directly_and_through_either_universal_form(ep2, tmp_path):
    """EP=2 x DP=2 -> EP=1 x DP=1: straight from the DeepSpeed checkpoint (load-time resharding), from our
    universal output, from upstream's (restored by deepspeed-ext), and ours restored by plain upstream DeepSpeed."""
    upstream = upstream_ds_to_universal(ep2.tag_dir, tmp_path / "upstream" / "global_step3_universal")
    ours_dir = _universal_save_dir(ep2.universal_dir, tmp_path, "ours")
    ep1 = ("--ep", "1")
    loads = [Load(1, 1, ep2.save_dir, load_universal=False, extra=ep1),
             Load(1, 1, ours_dir, extra=ep1),
             Load(1, 1, upstream.parent, extra=ep1),
             Load(1, 1, ours_dir, extra=(*ep1, "--plain"))]
    results = ep2.loaded_many(loads)
    what = ("direct", "our universal", "upstream's universal", "our universal, restored by upstream")
    for (dumps, losses), label in zip(results, what):
        _assert_continues(ep2, losses, label)
    # Every route restores the same bits: the next losses agree exactly.
    assert len({tuple(losses.values()) for _, losses in results}) == 1, [losses for _, losses in results]
    # The whole expert stack, restored on the single EP rank, is what EP=2's two ranks held.
    restored = results[0][0][0]
    live = ep2.live_experts()
    name = "model.layers.1.mlp.experts.w2"
    for state in STATES:
        assert torch.equal(restored[name][state], torch.cat([live[0][name][state], live[1][name][state]]))


def test_ep2_zero1_resumes_under_zero3_and_zero2_at_ep2(ep2):
    loads = [Load(1, 2, ep2.save_dir, load_universal=False, extra=("--zero", "3")),
             Load(1, 2, ep2.save_dir, load_universal=False, extra=("--zero", "2"))]
    for (_, losses), label in zip(ep2.loaded_many(loads), ("ZeRO-3", "ZeRO-2")):
        _assert_continues(ep2, losses, label)


def test_ep1_zero3_resumes_at_ep2_directly_and_through_the_universal_form(ep1_zero3, tmp_path):
    ours_dir = _universal_save_dir(ep1_zero3.universal_dir, tmp_path, "ours")
    loads = [Load(1, 2, ep1_zero3.save_dir, load_universal=False, extra=("--ep", "2")),
             Load(1, 2, ours_dir, extra=("--ep", "2", "--zero", "1"))]
    results = ep1_zero3.loaded_many(loads)
    for (_, losses), label in zip(results, ("direct, ZeRO-3", "universal, ZeRO-1")):
        _assert_continues(ep1_zero3, losses, label)
    live = ep1_zero3.live_experts()[0]
    loaded = ep1_zero3.live_experts(ep1_zero3.root / "loaded_tp1_dp2_ckpt_native_config_ep_2")
    name = "model.layers.0.mlp.experts.w1"
    for ep_rank in (0, 1):
        for state in STATES:
            assert torch.equal(loaded[ep_rank][name][state], live[name][state][2 * ep_rank:2 * ep_rank + 2])


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_other_autoep_presets_convert_resume_at_ep1_and_go_to_hf(scenarios, family):
    scenario = scenarios(f"autoep_{family}_ep2", tp=1, dp=2, ep=2, family=family, steps=4)
    # From the universal form (to-universal wrote it beside the tag; its tensors come from the reader a direct
    # load uses, which the Mixtral tests above load both ways).
    (_, losses), = scenario.loaded_many([Load(1, 1, scenario.save_dir, extra=("--ep", "1"))])
    _assert_continues(scenario, losses, f"{family} from the universal form")
    # And to transformers' names (DeepSeek-V3's router bias, a buffer, included): loads with nothing missing.
    from transformers import AutoModelForCausalLM
    hf = scenario.root / "hf"
    cli(["to-hf", str(scenario.save_dir), "-o", str(hf), "--quiet"], scenario.root / "to_hf.log")
    _, loading = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not any(loading.values()), loading


def test_to_hf_writes_the_models_names_and_transformers_loads_them(ep2, tmp_path):
    """AutoEP's router and w1/w2/w3 stacks go back to transformers' names (gate, fused gate_up_proj, down_proj) and
    its files' per-expert names; the model loads with nothing missing, weights equal to the merged masters in the
    model's bf16, and its logits match what the AutoEP engine computed at save time."""
    from transformers import AutoModelForCausalLM

    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.expert_names import model_named
    from deepspeed_ext.demo.models import eval_batch

    out = tmp_path / "hf"
    cli(["to-hf", str(ep2.save_dir), "-o", str(out), "--quiet"], tmp_path / "to_hf.log")
    model, loading = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(loading.values()), loading
    weights = model.state_dict()
    masters = {t.name: t.load_tensor("fp32") for t in model_named(DeepSpeedCheckpoint(ep2.tag_dir)).tensors()}
    assert sorted(masters) == sorted(name for name, _ in model.named_parameters())
    for name, master in masters.items():
        assert torch.equal(weights[name], master.to(weights[name].dtype)), name
    name = "model.layers.1.mlp.experts.gate_up_proj"
    live = ep2.live_experts()
    assert torch.equal(masters[name], torch.cat([torch.cat([live[r]["model.layers.1.mlp.experts.w1"]["fp32"],
                                                            live[r]["model.layers.1.mlp.experts.w3"]["fp32"]], 1)
                                                 for r in (0, 1)]))
    # compare views the AutoEP checkpoint under the model's names too: every tensor matches at bf16.
    proc = cli(["compare", str(ep2.save_dir), str(out)], tmp_path / "compare.log")
    assert "OK: within tolerance" in proc.stdout and "only in A (" not in proc.stdout, proc.stdout
    assert "only in B (" not in proc.stdout, proc.stdout
    with torch.no_grad():
        logits = model(input_ids=eval_batch()).logits.float()
    engine_logits = torch.load(ep2.dump_dir / "logits_tp_rank_00.pt", weights_only=True)
    # The same weights through AutoEP's expert kernels and transformers' own: bf16 rounding apart.
    assert (logits - engine_logits).abs().max() < 0.05, (logits - engine_logits).abs().max()


def test_from_hf_and_from_maxtext_output_resume_under_autoep(ep2, tmp_path):
    """The model's names back to AutoEP's at load time: from-maxtext output (weights, Adam moments, step) continues
    the run at EP=2 and EP=1; from-hf output (weights alone) loads the HF weights into every EP rank's experts."""
    maxtext = tmp_path / "maxtext"
    cli(["to-maxtext", str(ep2.save_dir), "-o", str(maxtext), "--with-optimizer", "--quiet"],
        tmp_path / "to_maxtext.log")
    back = tmp_path / "from_maxtext"
    cli(["from-maxtext", str(maxtext), "-o", str(back), "--quiet"], tmp_path / "from_maxtext.log")
    hf = tmp_path / "hf"
    cli(["to-hf", str(ep2.save_dir), "-o", str(hf), "--quiet", "--dtype", "float32"], tmp_path / "to_hf.log")
    from_hf = tmp_path / "from_hf"
    cli(["from-hf", str(hf), "-o", str(from_hf), "--quiet"], tmp_path / "from_hf.log")
    loads = [Load(1, 2, back), Load(1, 2, back, extra=("--ep", "1")), Load(1, 2, from_hf, extra=("--steps", "1"))]
    results = ep2.loaded_many(loads)
    for (_, losses), label in zip(results[:2], ("from-maxtext at EP=2", "from-maxtext at EP=1")):
        _assert_continues(ep2, losses, label)
    loaded = ep2.live_experts(ep2.root / "loaded_tp1_dp2_from_hf_steps_1")
    live = ep2.live_experts()
    for ep_rank in (0, 1):
        for name in ("model.layers.0.mlp.experts.w1", "model.layers.0.mlp.experts.w3"):
            assert torch.equal(loaded[ep_rank][name]["fp32"], live[ep_rank][name]["fp32"]), (ep_rank, name)


def test_ep_folded_with_tp_converts_and_resumes_at_ep1_tp1(scenarios):
    """AutoEP folded with AutoTP (EP=2 over the 2 TP ranks, DP=2: 4 ranks; attention split by the Mixtral preset),
    which upstream's converter cannot convert: each EP rank's experts, cut from our merged stacks, equal the live
    engine's bit for bit, and the run resumes at EP=1 x TP=1 straight from the checkpoint."""
    from deepspeed_ext.checkpoint import serialization
    folded = scenarios("autoep_mixtral_ep2_tp2", tp=2, dp=2, ep=2, family="mixtral", steps=4)
    live = folded.live_experts()
    assert sorted(live) == [0, 1]
    for name in ("model.layers.0.mlp.experts.w1", "model.layers.1.mlp.experts.w2"):
        for state in STATES:
            merged = serialization.load(folded.universal_dir / "zero" / name / f"{state}.pt")["param"]
            assert torch.equal(merged, torch.cat([live[0][name][state], live[1][name][state]])), (name, state)
    (_, losses), = folded.loaded_many([Load(1, 1, folded.save_dir, load_universal=False, extra=("--ep", "1"))])
    _assert_continues(folded, losses, "folded EP=2 x TP=2 -> EP=1 x TP=1")
