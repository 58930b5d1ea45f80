"""AutoEP checkpoints read without an engine: fake ZeRO-1 tag directories laid out as DeepSpeed 0.19.8 writes them
(per-expert model-states files, ``ds_autoep_layers``, an expert param group partitioned over the ranks holding the
same experts), in both of DeepSpeed's rank orders, and the one-line refusals of what is not read. The real engine's
checkpoints, against upstream's converter and resumed at other EP degrees: tests/e2e/test_expert_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepspeed.utils.tensor_fragment import fragment_address

from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
from deepspeed_ext.checkpoint.deepspeed.experts import expert_layout, read_expert_parallel
from deepspeed_ext.errors import CheckpointError

EXPERTS = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)  # 4 experts, each [3, 2]
DENSE = torch.arange(20, dtype=torch.float32).reshape(5, 4) / 10


def placement(ep: int, experts: int = 4) -> dict:
    per = experts // ep
    return {"version": 1, "num_experts": experts, "ep_size": ep,
            "ranks": [{"rank": r, "experts": list(range(r * per, (r + 1) * per))} for r in range(ep)]}


def fake_autoep(tag: Path, ep: int = 2, dp: int = 4, data_before_expert: bool = False, layer_record: dict | None = None,
                skip_expert_file: int | None = None, tp_world: int = 1) -> Path:
    """A ZeRO-1 AutoEP tag at TP=1: ``fc.weight`` partitioned over ``dp`` ranks, ``moe.experts.w1`` (4 experts) over
    ``ep`` EP ranks, each EP rank's stack partitioned over the ``dp / ep`` ranks holding it. Moments are the masters
    times 2 and 3, so a misplaced fragment shows."""
    tag.mkdir(parents=True)
    edp = dp // ep
    record = {"moe_layer_id": 0, "module_path": "moe", "num_experts": 4, "num_local_experts": 4 // ep, "ep_size": ep,
              "expert_placement": placement(ep), "expert_key_prefix": "moe.experts",
              "checkpoint_format": "per_expert_files", **(layer_record or {})}
    local_shape = (4 // ep, 3, 2)
    torch.save({"module": {"fc.weight": DENSE.bfloat16()}, "buffer_names": [],
                "param_shapes": [{"fc.weight": (5, 4)}, {"moe.experts.w1": local_shape}],
                "global_steps": 3, "mp_world_size": tp_world, "dp_world_size": dp, "ds_version": "0.19.8",
                "ds_config": {"use_data_before_expert_parallelism": data_before_expert},
                "ds_autoep_layers": [record]},
               tag / "mp_rank_00_model_states.pt")
    for expert in range(4):
        if expert != skip_expert_file:
            torch.save({f"moe.experts.w1.{expert}": EXPERTS[expert].bfloat16()},
                       tag / f"layer_0_expert_{expert}_mp_rank_00_model_states.pt")
    dense = DENSE.reshape(-1).chunk(dp)
    for rank in range(dp):
        ep_rank = rank // edp if data_before_expert else rank % ep
        edp_rank = rank % edp if data_before_expert else rank // ep
        stack = EXPERTS[ep_rank * (4 // ep):(ep_rank + 1) * (4 // ep)].reshape(-1)
        part = stack.chunk(edp)[edp_rank].clone()
        flat = [dense[rank].clone(), part]
        state = {group: {"step": torch.tensor(3.0), "exp_avg": t * 2, "exp_avg_sq": t * 3}
                 for group, t in enumerate(flat)}
        torch.save({"optimizer_state_dict": {
            "zero_stage": 1, "partition_count": [dp, edp], "loss_scaler": None, "clip_grad": 1.0,
            "base_optimizer_state": {"state": state, "param_groups": [
                {"name": "dense-params", "lr": 1e-2, "params": [0]},
                {"name": f"ep_size_{ep}", "moe": True, "lr": 1e-2, "params": [1]}]},
            "single_partition_of_fp32_groups": flat,
            "param_slice_mappings": [{"fc.weight": fragment_address(numel=flat[0].numel(), start=0)},
                                     {"moe.experts.w1": fragment_address(numel=part.numel(), start=0)}]}},
            tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return tag


@pytest.mark.parametrize("data_before_expert", [False, True])
@pytest.mark.parametrize("ep, dp", [(2, 4), (2, 2), (4, 4), (1, 2)])
def test_experts_merge_to_the_logical_stack_in_either_rank_order(tmp_path, ep, dp, data_before_expert):
    ckpt = DeepSpeedCheckpoint(fake_autoep(tmp_path / "tag", ep=ep, dp=dp, data_before_expert=data_before_expert))
    layout = ckpt.layouts["moe.experts.w1"]
    assert layout.shape == (4, 3, 2) and layout.tp_size == ep and layout.role == "experts"
    for state, factor in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
        assert torch.equal(ckpt.full_tensor("moe.experts.w1", state), EXPERTS * factor), state
        assert torch.equal(ckpt.full_tensor("fc.weight", state), DENSE * factor), state
        # Streamed in blocks, as the sinks read it.
        flat = ckpt.full_range("moe.experts.w1", state, 5, 19)
        assert torch.equal(flat, (EXPERTS * factor).reshape(-1)[5:19])
        # Resharded at load time for another EP degree: each target EP rank's experts.
        for target_ep in (1, 2, 4):
            target = expert_layout((4, 3, 2), [4 // target_ep] * target_ep)
            for rank in range(target_ep):
                expected = (EXPERTS * factor)[rank * (4 // target_ep):(rank + 1) * (4 // target_ep)]
                assert torch.equal(ckpt.resharded("moe.experts.w1", state, target, rank), expected)
    assert int(ckpt.step("moe.experts.w1")) == 3
    summary = ckpt.summary()["expert_parallel"]
    assert summary["ep_degree"] == ep and summary["experts_per_rank"] == 4 // ep
    assert summary["expert_dp_degree"] == dp // ep


def test_missing_expert_file_is_named(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(fake_autoep(tmp_path / "tag", skip_expert_file=2))
    assert str(caught.value).startswith(f"{tmp_path / 'tag'}: layer_0_expert_2_mp_rank_00_model_states.pt is "
                                        "missing"), caught.value


def test_placement_that_is_not_consecutive_experts_is_refused(tmp_path):
    scattered = {"version": 1, "num_experts": 4, "ep_size": 2,
                 "ranks": [{"rank": 0, "experts": [0, 2]}, {"rank": 1, "experts": [1, 3]}]}
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(fake_autoep(tmp_path / "tag", layer_record={"expert_placement": scattered}))
    message = str(caught.value)
    assert message.startswith(str(tmp_path / "tag" / "mp_rank_00_model_states.pt")) and "consecutive" in message


def _affine_map(ep: int, offsets: list[int]) -> dict:
    per = 4 // ep
    return {"version": 1, "params": {"moe.experts.w1": {"logical_shape": [4, 3, 2], "ranks": {
        rank: {"shard_shape": [per, 3, 2], "pieces": [{"shape": [per, 3, 2], "source": [offset, [6, 2, 1]],
                                                       "dest": [0, [6, 2, 1]], "locations": [rank]}]}
        for rank, offset in enumerate(offsets)}}}}


def test_the_affine_placement_map_must_agree_with_the_placement(tmp_path):
    """DeepSpeed writes each stack's placement twice (``expert_placement``, ``affine_maps``); a map that puts a rank's
    experts elsewhere is refused, one that agrees is read."""
    ckpt = DeepSpeedCheckpoint(fake_autoep(tmp_path / "ok", layer_record={"affine_maps": _affine_map(2, [0, 12])}))
    assert torch.equal(ckpt.full_tensor("moe.experts.w1"), EXPERTS)
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(fake_autoep(tmp_path / "off", layer_record={"affine_maps": _affine_map(2, [0, 6])}))
    assert "the affine map of 'moe.experts.w1' places EP rank 1's share as [(6, [2, 3, 2])]" in str(caught.value)


def test_partition_count_that_fits_neither_group_says_what_was_expected(tmp_path):
    tag = fake_autoep(tmp_path / "tag")
    path = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = torch.load(path, weights_only=False)
    data["optimizer_state_dict"]["partition_count"] = [4, 4]
    torch.save(data, path)
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(tag)
    assert str(caught.value) == (f"{path}: param group 1 is partitioned over 4 ranks, but DP=4 / EP=2 ranks hold each "
                                 "expert: files of two checkpoints, or a DeepSpeed partitioning not supported")


def test_tp_without_deepspeeds_folding_record_is_refused_in_one_line(tmp_path):
    """AutoEP at TP=2 is read as DeepSpeed folds it (one EP rank per TP rank, its record in each TP rank's model
    states: tests/e2e/test_expert_parallel.py); TP rank files without that record are refused."""
    tag = fake_autoep(tmp_path / "tag")
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    torch.save({**states, "mp_world_size": 2}, tag / "mp_rank_01_model_states.pt")
    torch.save({**states, "mp_world_size": 2}, tag / "mp_rank_00_model_states.pt")
    for rank in range(4):
        source = tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        (tag / f"bf16_zero_pp_rank_{rank}_mp_rank_01_optim_states.pt").write_bytes(source.read_bytes())
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(tag)
    assert "AutoEP at TP=2 without DeepSpeed's folding record" in str(caught.value) and "\n" not in str(caught.value)


def test_expert_files_of_deepspeeds_older_moe_layer_are_refused(tmp_path):
    tag = fake_autoep(tmp_path / "tag")
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    del states["ds_autoep_layers"]
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError) as caught:
        DeepSpeedCheckpoint(tag)
    assert str(caught.value).startswith(f"{tag / 'layer_0_expert_0_mp_rank_00_model_states.pt'}: an expert "
                                        "checkpoint file, but"), caught.value


def test_ep_that_does_not_divide_dp_is_refused(tmp_path):
    states = {"param_shapes": [{"moe.experts.w1": (2, 3, 2)}],
              "ds_autoep_layers": [{"moe_layer_id": 0, "num_experts": 4, "ep_size": 2,
                                    "expert_key_prefix": "moe.experts", "expert_placement": placement(2)}]}
    with pytest.raises(CheckpointError, match="EP=2 does not divide DP=3"):
        read_expert_parallel(states, Path("m.pt"), 3)
    assert read_expert_parallel({"param_shapes": [{"a": (2,)}]}, Path("m.pt"), 3) is None


def _source(held: dict[str, torch.Tensor]):
    """A source holding ``held`` under AutoEP's names (master weights only), read in ranges."""
    from deepspeed_ext.checkpoint.source import SourceInfo
    from deepspeed_ext.checkpoint.tensor import LogicalTensor
    from deepspeed_ext.module_inject.layout import TPLayout

    class Source:
        info = SourceInfo(format="test", given=Path("x"), path=Path("x"), states=("fp32", ),
                          layouts={name: TPLayout.replicated(tuple(t.shape), 1) for name, t in held.items()})
        read_paths: list[Path] = []

        def tensors(self):
            for name, value in held.items():
                yield LogicalTensor(name=name, shape=tuple(value.shape), layout=self.info.layouts[name],
                                    states=("fp32", ), loader=lambda state, v=value: v,
                                    range_loader=lambda state, low, high, v=value: v.reshape(-1)[low:high])

        def summary(self):
            return {}

        def raise_if_damaged(self):
            pass

    return Source()


def test_autoep_names_read_as_the_models_fused_tensors_in_any_block():
    from deepspeed_ext.checkpoint.expert_names import model_named
    w1, w3 = torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    source = {"m.layers.0.mlp.router.gate.weight": torch.randn(4, 5), "m.layers.0.mlp.experts.w1": w1,
              "m.layers.0.mlp.experts.w2": torch.randn(4, 5, 3), "m.layers.0.mlp.experts.w3": w3,
              "m.norm.weight": torch.randn(5)}
    named = model_named(_source(source))
    assert sorted(named.info.layouts) == ["m.layers.0.mlp.experts.down_proj", "m.layers.0.mlp.experts.gate_up_proj",
                                          "m.layers.0.mlp.gate.weight", "m.norm.weight"]
    tensors = {t.name: t for t in named.tensors()}
    fused = torch.cat([w1, w3], dim=1)
    assert torch.equal(tensors["m.layers.0.mlp.experts.gate_up_proj"].load_tensor("fp32"), fused)
    for block in (1, 7, 15, 30, 120):  # blocks across the w1/w3 seams and the experts
        got = torch.cat(list(tensors["m.layers.0.mlp.experts.gate_up_proj"].blocks("fp32", block_elements=block)))
        assert torch.equal(got, fused.reshape(-1)), block
    assert torch.equal(tensors["m.layers.0.mlp.experts.down_proj"].load_tensor("fp32"),
                       source["m.layers.0.mlp.experts.w2"])


def test_the_models_names_read_as_autoeps_by_an_expert_parallel_engine(tmp_path):
    """from-hf output resumed under AutoEP: each EP rank's w1 / w3 rows are the halves of gate_up_proj."""
    from deepspeed_ext.checkpoint.expert_names import autoep_named
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    fused = torch.randn(4, 6, 5)
    zero = tmp_path / "u" / "zero"
    for name, value in (("m.mlp.experts.gate_up_proj", fused), ("m.mlp.gate.weight", torch.randn(4, 5))):
        (zero / name).mkdir(parents=True)
        torch.save({"param": value}, zero / name / "fp32.pt")
    source = autoep_named(UniversalCheckpoint(tmp_path / "u"), ["m.mlp.experts.w1", "m.mlp.experts.w3"])
    assert sorted(source.names) == ["m.mlp.experts.w1", "m.mlp.experts.w3", "m.mlp.router.gate.weight"]
    for ep in (1, 2, 4):
        layout = expert_layout((4, 3, 5), [4 // ep] * ep)
        for rank in range(ep):
            experts = slice(rank * 4 // ep, (rank + 1) * 4 // ep)
            assert torch.equal(source.resharded("m.mlp.experts.w1", "fp32", layout, rank), fused[experts, :3])
            assert torch.equal(source.resharded("m.mlp.experts.w3", "fp32", layout, rank), fused[experts, 3:])
            whole = source.resharded_range("m.mlp.experts.w3", "fp32", layout, rank, 2, 13)
            assert torch.equal(whole, fused[experts, 3:].reshape(-1)[2:13])
