"""Weight streams without an engine: the plan (who sends what), landing pieces in place for every kind of TP
layout, the scratch memory, the HF names, dtypes and FP8 of a stream, the sinks' checks, and pieces over a real
weight group (gloo, two threads). The engine's side runs in tests/e2e/test_weight_streaming_e2e.py."""

from __future__ import annotations

import math
import socket
import threading

import pytest
import torch

from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.weights.naming import StreamedSource, WeightOptions, named_shapes, named_tensors
from deepspeed_ext.weights.plan import (Bucket, Holding, Landing, Scratch, WeightPlan, buckets_of, pack,
                                        plan_from_holdings)
from deepspeed_ext.weights.sinks import CallbackSink, LoadWeightsSink, ModuleSink, sink_for

LAYOUTS = {
    "replicated": TPLayout.replicated((6, 5), 2),
    "rows, uneven": TPLayout.split((7, 4), 2, 0, (4, 3), "column"),
    "columns": TPLayout.split((4, 6), 2, 1, (3, 3), "row"),
    "fused q/k/v": TPLayout.sub_params((12, 4), 2, 0, (6, 3, 3), ((3, 3), (2, 1), (2, 1))),
    "empty shard": TPLayout.split((4, 3), 3, 0, (2, 2, 0), "column"),
    "bias of rows": TPLayout.split((9, ), 3, 0, (3, 3, 3), "column"),
}


def _holdings(layouts: dict[str, TPLayout], dp: int) -> list[list[Holding]]:
    """Ranks TP-major within DP (rank = dp_rank * tp + tp_rank), ZeRO-3-like when ``dp`` > 1: each DP rank holds its
    part of the shard flattened."""
    tp = max(layout.tp_size for layout in layouts.values())
    ranks: list[list[Holding]] = [[] for _ in range(tp * dp)]
    for name, layout in layouts.items():
        for shard in range(layout.tp_size):
            numel = math.prod(layout.local_shape(shard))
            part = -(-numel // dp)
            for dp_rank in range(dp):
                start, stop = min(dp_rank * part, numel), min((dp_rank + 1) * part, numel)
                ranks[dp_rank * tp + shard].append(Holding(name, 0 if layout.is_replicated else shard, start, stop))
    return ranks


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("small, packed", [(0, 0), (64, 100), (1 << 20, 4 << 20)],
                         ids=["every piece alone", "small ones in packs of 100 bytes", "every piece packed"])
def test_every_layout_lands_whole(dp, small, packed, monkeypatch):
    from deepspeed_ext.weights import plan as plan_module
    monkeypatch.setattr(plan_module, "SMALL_PIECE_BYTES", small)
    monkeypatch.setattr(plan_module, "PACK_BYTES", packed)
    fulls = {name: torch.arange(layout.numel, dtype=torch.float32).reshape(layout.shape).to(torch.bfloat16)
             for name, layout in LAYOUTS.items()}
    plans = plan_from_holdings(LAYOUTS, {n: torch.bfloat16 for n in LAYOUTS}, {n: True for n in LAYOUTS},
                               _holdings(LAYOUTS, dp))
    for bucket_bytes in (1, 40, 1 << 20):
        sent: dict[str, torch.Tensor] = {}
        got: dict[str, torch.Tensor] = {}
        scratches = Scratch(), Scratch()
        for bucket in buckets_of(plans, bucket_bytes):
            def own(plan, piece):  # every owner's values of its piece: its shard's elements, flattened
                flat = LAYOUTS[plan.name].slice(fulls[plan.name], piece.shard).reshape(-1)
                return flat[piece.start:piece.stop]
            wire: dict[int, list[torch.Tensor]] = {}

            def send(owner, tensor):
                wire.setdefault(owner, []).append(tensor.clone())

            def receive(owner, buffer):  # the messages of each owner in the order they were sent, size for size
                message = wire[owner].pop(0)
                assert message.shape == buffer.shape and message.dtype == buffer.dtype
                buffer.copy_(message)
            fresh = lambda plan: torch.full(plan.layout.shape, -1, dtype=plan.dtype)  # noqa: E731
            # A sending rank (every owner at once: each piece's values its own) and a rank that receives it all.
            sent.update(Landing(bucket, fresh, send, own, scratches[0]).finish())
            got.update(Landing(bucket, fresh, receive, None, scratches[1]).finish())
            assert not any(wire.values())
        for name, full in fulls.items():
            assert torch.equal(sent[name], full) and torch.equal(got[name], full), (name, dp, bucket_bytes)


def test_replicas_share_the_sending_and_every_range_is_sent_once():
    layouts = {f"w{i}": TPLayout.replicated((4, 4), 1) for i in range(4)}
    holdings = [[Holding(name, 0, 0, 16) for name in layouts] for _ in range(2)]  # DP=2 replicas
    plans = plan_from_holdings(layouts, {n: torch.float32 for n in layouts}, {n: True for n in layouts}, holdings)
    assert [p.pieces[0].owner for p in plans] == [0, 1, 0, 1]
    assert all(len(p.pieces) == 1 and p.pieces[0].numel == 16 for p in plans)
    # Under TP a replicated tensor (an embedding) that would leave one rank the busiest is split over its holders, so
    # that both end with the same bytes; ranges below the split size go whole.
    tp_layouts = {"embed": TPLayout.replicated((10, 8), 2), "q": TPLayout.split((8, 4), 2, 0, (4, 4), "column"),
                  "norm": TPLayout.replicated((4, ), 2)}
    tp_holdings = [[Holding("embed", 0, 0, 80), Holding("q", rank, 0, 16), Holding("norm", 0, 0, 4)] for rank in (0, 1)]
    plans = plan_from_holdings(tp_layouts, {n: torch.float32 for n in tp_layouts}, {n: True for n in tp_layouts},
                               tp_holdings, min_split_bytes=16)
    assert [(p.owner, p.start, p.stop) for p in plans[0].pieces] == [(0, 0, 40), (1, 40, 80)]
    assert len(plans[2].pieces) == 1
    sent = [sum(p.numel for plan in plans for p in plan.pieces if p.owner == rank) for rank in (0, 1)]
    assert abs(sent[0] - sent[1]) <= 4
    whole = plan_from_holdings(tp_layouts, {n: torch.float32 for n in tp_layouts}, {n: True for n in tp_layouts},
                               tp_holdings, min_split_bytes=1 << 20)
    assert [len(p.pieces) for p in whole] == [1, 2, 1]
    # However small the split size, every part is at least one element, and each rank's messages hold them all.
    skewed = [[Holding("embed", 0, 0, 80)] + ([Holding("q", 0, 0, 32)] if rank == 0 else []) for rank in range(3)]
    for min_split in (0, 1, 3):
        plans = plan_from_holdings({"embed": tp_layouts["embed"], "q": TPLayout.replicated((8, 4), 3)},
                                   {"embed": torch.float32, "q": torch.float32}, {"embed": True, "q": True}, skewed,
                                   min_split_bytes=min_split)
        assert all(p.numel > 0 for plan in plans for p in plan.pieces), min_split
        (bucket, ) = buckets_of(plans, 1 << 20)
        for rank in range(3):
            assert [piece for m in bucket.messages(rank) for piece in m] == bucket.pieces_of(rank)
    with pytest.raises(CheckpointError, match=r"^w0: no rank holds elements from 8 of shard 0 \(16 elements\)"):
        plan_from_holdings({"w0": layouts["w0"]}, {"w0": torch.float32}, {"w0": True}, [[Holding("w0", 0, 0, 8)]])


def test_a_plan_travels_as_json():
    plans = plan_from_holdings(LAYOUTS, {n: torch.float16 for n in LAYOUTS}, {n: n != "columns" for n in LAYOUTS},
                               _holdings(LAYOUTS, 2))
    plan = WeightPlan(plans, 6, {"model_type": "llama"}, "LlamaForCausalLM", None)
    again = WeightPlan.from_json(plan.to_json())
    assert again.tensors == plan.tensors and again.model_config == plan.model_config and again.ranks == 6


def test_scratch_is_reused_and_grows_to_what_a_bucket_needs():
    scratch = Scratch()
    first = scratch.take(100, torch.float32, torch.device("cpu"))
    beyond = scratch.take(1000, torch.float32, torch.device("cpu"))  # more than this bucket's memory: fresh, once
    assert beyond.numel() == 1000 and first.numel() == 100
    scratch.reset()
    again = scratch.take(100, torch.float32, torch.device("cpu"))
    more = scratch.take(1000, torch.float32, torch.device("cpu"))
    assert again.untyped_storage().data_ptr() == more.untyped_storage().data_ptr()  # one block, grown


def _source_of(model: torch.nn.Module, config: dict, adapters: dict | None = None) -> StreamedSource:
    """A stream of a module's own tensors (TP=1, one rank), as the engine's side builds it."""
    state = dict(model.named_parameters())
    layouts = {name: TPLayout.replicated(tuple(p.shape), 1) for name, p in state.items()}
    plans = plan_from_holdings(layouts, {n: p.dtype for n, p in state.items()}, {n: True for n in state},
                               [[Holding(n, 0, 0, p.numel()) for n, p in state.items()]])
    plan = WeightPlan(plans, 1, config, type(model).__name__, adapters)
    buckets = iter([{name: state[name].detach().clone() for name in layouts}])
    return StreamedSource(plan, buckets, "test model")


def _tiny(family: str) -> tuple[torch.nn.Module, dict]:
    import json

    from transformers import AutoModelForCausalLM

    from deepspeed_ext.demo.models import tiny_config
    config = tiny_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model, json.loads(config.to_json_string(use_diff=False))


def test_names_dtypes_and_expert_files():
    model, config = _tiny("mixtral")
    options = WeightOptions(names="files", dtype="float32")
    shapes = named_shapes(_source_of(model, config), options)
    streamed = dict(named_tensors(_source_of(model, config), options))
    assert list(streamed) == list(shapes) and all(tuple(streamed[n].shape) == shapes[n] for n in shapes)
    assert all(t.dtype == torch.float32 for t in streamed.values())
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    expert = fused.shape[1] // 2
    assert torch.equal(streamed["model.layers.0.block_sparse_moe.experts.1.w3.weight"], fused[1, expert:].float())
    hf = dict(named_tensors(_source_of(model, config), WeightOptions()))
    assert list(hf) == [name for name, _ in model.named_parameters()]  # the model's names, its dtype
    assert all(hf[name].dtype == torch.bfloat16 for name in hf)


def test_fp8_as_to_hf_writes_it():
    from deepspeed_ext.checkpoint.quantization import quantize_fp8
    model, config = _tiny("llama")
    options = WeightOptions(names="files", quantize="fp8", fp8_block=(16, 16))
    streamed = dict(named_tensors(_source_of(model, config), options))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    values, scale_inv = quantize_fp8(model.get_parameter(q_proj).detach().float(), (16, 16))
    assert streamed[q_proj].dtype == torch.float8_e4m3fn and torch.equal(streamed[q_proj].view(torch.uint8),
                                                                          values.view(torch.uint8))
    assert torch.equal(streamed[q_proj + "_scale_inv"], scale_inv)
    assert "model.norm.weight_scale_inv" not in streamed and streamed["model.norm.weight"].dtype == torch.bfloat16


def test_options_are_checked_up_front():
    with pytest.raises(ValueError, match="names='files'"):
        WeightOptions(quantize="fp8")
    with pytest.raises(ValueError, match="choose one of hf, files, module"):
        WeightOptions(names="vllm")
    with pytest.raises(CheckpointError, match="--dtype must be one of"):
        WeightOptions(dtype="int3")


def test_a_module_sink_refuses_what_does_not_fit_in_one_line():
    model, config = _tiny("llama")
    sink = ModuleSink(model)
    shapes = named_shapes(_source_of(model, config), WeightOptions())
    sink.check(shapes, "weight update 1")  # its own shapes fit
    bad = {**shapes, "model.layers.0.self_attn.k_proj.weight": (8, 64)}
    with pytest.raises(CheckpointError, match=r"^weight update 1: model.layers.0.self_attn.k_proj.weight is \[8, 64\] "
                                              r"in the update, \[16, 64\] in the receiving LlamaForCausalLM"):
        sink.check(bad, "weight update 1")
    with pytest.raises(CheckpointError, match="has no place in the receiving"):
        sink.check({**shapes, "model.extra.weight": (2, 2)}, "weight update 1")
    missing = {n: s for n, s in shapes.items() if n != "model.norm.weight"}
    with pytest.raises(CheckpointError, match="the update carries no model.norm.weight"):
        sink.check(missing, "weight update 1")


def test_sinks_by_what_is_given():
    model, _ = _tiny("llama")

    class VllmLike:
        def load_weights(self, weights):
            return set()
    assert isinstance(sink_for(model), ModuleSink) and sink_for(model).names == "hf"
    assert isinstance(sink_for(VllmLike()), LoadWeightsSink) and sink_for(VllmLike()).names == "files"
    assert isinstance(sink_for(lambda name, tensor: None), CallbackSink)
    with pytest.raises(TypeError, match="a weight sink is"):
        sink_for(3)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_weight_group_uses_the_interfaces_gloo_is_told(monkeypatch):
    """GLOO_SOCKET_IFNAME names the interfaces torch's own gloo groups use; a weight group's groups use them too (an
    interface that does not exist is an error, as it is for torch's groups, not the default one taken instead)."""
    from deepspeed_ext.weights.groups import WeightGroup
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(RuntimeError, match="nosuchif0"):
        WeightGroup("127.0.0.1", _free_port(), senders=1, rank=0, timeout=10)


def test_pieces_over_a_weight_group_and_a_sender_gone(monkeypatch):
    """A bucket sent over a real group (gloo, two threads: training rank 0 and one receiver), then the sender's
    group given up mid-bucket: the receiver's wait ends with an error instead of hanging."""
    from deepspeed_ext.weights.groups import WeightGroup
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # Linux's loopback, named: the groups take the interface named
    layouts = {"rows": LAYOUTS["rows, uneven"], "columns": LAYOUTS["columns"]}
    fulls = {name: torch.randn(layout.shape) for name, layout in layouts.items()}
    plans = plan_from_holdings({n: TPLayout.replicated(l.shape, 1) for n, l in layouts.items()},
                               {n: torch.float32 for n in layouts}, {n: True for n in layouts},
                               [[Holding(n, 0, 0, l.numel) for n, l in layouts.items()]])
    (bucket, ) = buckets_of(plans, 1 << 20)
    port = _free_port()
    groups: dict[str, WeightGroup] = {}

    def join(role: str) -> None:
        if role == "sender":
            groups[role] = WeightGroup("127.0.0.1", port, senders=1, rank=0, timeout=30)
        else:
            groups[role] = WeightGroup("127.0.0.1", port, senders=1, receiver=0, timeout=30)
    threads = [threading.Thread(target=join, args=(role, )) for role in ("sender", "receiver")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sender, receiver = groups["sender"], groups["receiver"]
    messages = bucket.messages(0)
    assert [len(m) for m in messages] == [2]  # two small tensors: one message, packed
    for message in messages:
        sender.broadcast(0, pack([fulls[plan.name].reshape(-1)[piece.start:piece.stop] for plan, piece in message]))
    landing = Landing(bucket, lambda plan: torch.empty(plan.layout.shape), receiver.broadcast)
    got = landing.finish()
    assert all(torch.equal(got[name], fulls[name]) for name in fulls)
    # Now the sender gives up before sending: the receiver's posted receives fail, they do not wait forever.
    waiting = Landing(Bucket(bucket.tensors), lambda plan: torch.empty(plan.layout.shape), receiver.broadcast)
    sender.close("test: the sender is gone")
    with pytest.raises(RuntimeError):
        waiting.finish()
    receiver.close()
