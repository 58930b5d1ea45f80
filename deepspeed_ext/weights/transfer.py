"""Weight updates between a training job and its receivers: :func:`send_weights` on every training rank,
:func:`receive_weights` on every receiver, over a :class:`~deepspeed_ext.weights.groups.WeightGroup`.

An update, on the wire:

1. training rank 0, in its group: a header (``[magic, version, length]``, then the plan as JSON: every tensor's
   layout, dtype and pieces, the model's config and adapters, the bucket size; the same text from one update to the
   next while the plan is the same);
2. every training rank, in its own group: each piece it sends, bucket by bucket in the plan's order, a large one as
   one message from where it keeps it, small neighbours packed together
   (:meth:`~deepspeed_ext.weights.plan.Bucket.messages`);
3. every training rank: a trailer ``[magic, version, bytes sent]``.

A receiver receives each piece where its tensor goes (:class:`~deepspeed_ext.weights.plan.Landing`: in place in a
module sink where the names and dtype allow), names the tensors as its sink loads them (the converters' names,
:mod:`~deepspeed_ext.weights.naming`) and hands them on, so it holds a few buckets at a time. It
refuses an update whose version is not the one after the last it saw (it missed one), and one that ends early or
short (a training rank died): in one line, after which the group is given up, so no peer waits forever.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed_ext.checkpoint.expert_names import has_autoep_names
from deepspeed_ext.checkpoint.families import hf_expert_splits
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.weights.engine_sink import EngineSink, is_engine
from deepspeed_ext.weights.groups import WeightGroup
from deepspeed_ext.weights.naming import StreamedSource, WeightOptions, named_shapes, named_tensors
from deepspeed_ext.weights.plan import Bucket, Landing, TensorPlan, WeightPlan, pack
from deepspeed_ext.weights.sinks import ModuleSink, Sink, sink_for

_HEADER, _TRAILER = 0x6473785748, 0x6473785754  # "dsxWH", "dsxWT"
#: Buckets a training rank keeps in flight: it waits for a bucket's sends only once the next one is started.
_IN_FLIGHT = 2
DEFAULT_BUCKET_BYTES = 32 << 20
#: Buckets a receiver has posted beyond the one it is putting in place: the senders' bytes keep flowing meanwhile.
_LOOKAHEAD = 2


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def send_weights(engine: Any, group: WeightGroup, *, version: int | None = None, adapters_only: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Send ``engine``'s full weights to the receivers of ``group``; every training rank calls it (collective
    the first time: the ranks agree on who sends what). Each rank broadcasts only the pieces it holds. Returns the
    update's version: ``version``, else one more than the last sent (1 first). ``adapters_only``: a peft model's
    adapters alone (LoRA RL: a few MB)."""
    from deepspeed_ext.weights.engine_side import adapters_plan, engine_plan, local_tensors, own_values
    if not group.is_sender:
        raise ValueError("send_weights runs on the training ranks; a receiver calls receive_weights")
    assert group.rank is not None
    plan = adapters_plan(engine_plan(engine)) if adapters_only else engine_plan(engine)
    if plan.ranks != group.senders:
        raise CheckpointError(f"weight group: made for {group.senders} training ranks, the engine runs on {plan.ranks}")
    version = (group.last_version or 0) + 1 if version is None else int(version)
    device = group.device
    rank = group.rank
    sent = 0
    try:
        if rank == 0:
            text = json.dumps({"plan": plan.to_json(), "bucket_bytes": bucket_bytes,
                               "adapters_only": adapters_only}).encode()
            group.broadcast(0, _int64([_HEADER, version, len(text)], device)).wait()
            group.broadcast(0, torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)).wait()
        # Each piece from where this rank keeps it; a bucket's sends wait for those of the bucket before last.
        in_flight: list[list[tuple[Any, torch.Tensor]]] = []
        local = local_tensors(engine)
        for bucket in plan.buckets(bucket_bytes):
            works = []
            for message in bucket.messages(rank):
                parts = [own_values(local, tensor_plan, piece) for tensor_plan, piece in message]
                values = (parts[0] if len(parts) == 1 else pack(parts)).to(device)
                works.append((group.broadcast(rank, values), values))
                sent += values.numel() * values.element_size()
            in_flight.append(works)
            if len(in_flight) >= _IN_FLIGHT:
                for work, _ in in_flight.pop(0):
                    work.wait()
        for works in in_flight:
            for work, _ in works:
                work.wait()
        group.broadcast(rank, _int64([_TRAILER, version, sent], device)).wait()
    except CheckpointError:
        raise
    except Exception as exc:  # a receiver gone: torch's error runs over several lines
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        group.close(f"update {version} failed on training rank {rank}: {reason}")
        raise CheckpointError(f"weight update {version}: training rank {rank} could not send it: {reason}") from exc
    group.last_version = version
    return version


def receive_weights(group: WeightGroup, sink: Any, *, names: str | None = None, dtype: str = "source",
                    quantize: str | None = None, fp8_block: tuple[int, int] = (128, 128), atomic: bool = False,
                    expect_version: int | None = None) -> int:
    """Receive the next update of ``group`` into ``sink`` (a torch module, loaded in place; a DeepSpeed engine, each
    of whose ranks is a receiver and keeps its own shards; a model with vLLM's ``load_weights``; a callable
    ``(name, tensor)``); returns its version.

    ``names``: what the sink loads (default: the model's names for a module, the HF files' for ``load_weights``).
    ``dtype``, ``quantize``, ``fp8_block``: as :func:`~deepspeed_ext.hf_weights`. ``atomic``: hold the whole update
    and load it only once it is complete (memory: the model once more); else tensors are loaded as they arrive, and a
    failed update leaves the sink with part of it, which the error says. ``expect_version``: the version to accept
    (default: one more than the last seen, any for the first). Every refusal is one line; the update's bytes are
    received anyway, so the senders are not left waiting."""
    if group.is_sender:
        raise ValueError("receive_weights runs on a receiver; the training ranks call send_weights")
    device = group.device
    state = {"label": "weight update", "loading": False}
    try:
        version = _receive(group, sink, names, dtype, quantize, fp8_block, atomic, expect_version, state)
    except UpdateRefused:
        raise  # refused before any of it was loaded, and received to its end: the group goes on
    except CheckpointError as exc:
        group.close(str(exc))
        raise
    except Exception as exc:  # a training rank gone mid-update: torch's error runs over several lines
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        left = ("the sink holds part of it (tensors were loaded as they arrived)" if state["loading"] else
                _kept(group))
        group.close(f"{state['label']} failed: {reason}")
        raise CheckpointError(f"{state['label']}: incomplete, refused ({reason}); {left}") from exc
    group.last_version = group.applied_version = version
    return version


class UpdateRefused(CheckpointError):
    """An update refused before any of it was loaded (missed versions, a sink it does not fit), after its bytes
    were received to the end: the group is still in step, the next update can be received."""


def _receive(group: WeightGroup, sink: Any, names: str | None, dtype: str, quantize: str | None,
             fp8_block: tuple[int, int], atomic: bool, expect_version: int | None, state: dict[str, Any]) -> int:
    device = group.device
    head = torch.empty(3, dtype=torch.int64, device=device)
    group.broadcast(0, head).wait()
    magic, version, length = (int(v) for v in head.cpu())
    if magic != _HEADER:
        raise CheckpointError("weight update: the stream is out of step (no update header where one was due)")
    label = state["label"] = f"weight update {version}"
    text = torch.empty(length, dtype=torch.uint8, device=device)
    group.broadcast(0, text).wait()
    raw = bytes(text.cpu().numpy())
    # The header of the update before, where this one's is the same (the usual case: the version travels apart):
    # its plan's buckets and messages are worked out already.
    if group.received_plan is not None and group.received_plan[0] == raw:
        header, plan = group.received_plan[1:]
    else:
        header = json.loads(raw)
        plan = WeightPlan.from_json(header["plan"])
        group.received_plan = (raw, header, plan)
    if plan.ranks != group.senders:
        raise CheckpointError(f"{label}: sent by {plan.ranks} training ranks, the group has {group.senders}")
    adapters_only = bool(header["adapters_only"])
    target = EngineSink(sink) if is_engine(sink) else sink_for(sink, names, adapters_only)
    options = WeightOptions(names=target.names, dtype=dtype, quantize=quantize, fp8_block=fp8_block,
                            adapters="only" if adapters_only and target.names != "module" else "merge")
    sent: dict[int, int] = {}
    buckets = plan.buckets(int(header["bucket_bytes"]))

    def fresh(tensor_plan: TensorPlan) -> torch.Tensor:
        return torch.empty(tensor_plan.layout.shape, dtype=tensor_plan.dtype, device=device)
    expected = expect_version if expect_version is not None else (
        None if group.last_version is None else group.last_version + 1)
    problem = None
    if expected is not None and version != expected:
        problem = f"{label}: expected version {expected}, this is {version} (an update was missed); refused, "
        problem += _kept(group)
    else:
        try:
            target.check(named_shapes(StreamedSource(plan, iter(()), label), options), label)
        except CheckpointError as exc:
            problem = f"{exc}; refused, {_kept(group)}"
    if problem is not None:
        for _ in _received(group, buckets, sent, device, fresh):  # the senders' pieces, taken and dropped
            pass
        _check_trailers(group, version, sent, device, label)
        group.last_version = version
        raise UpdateRefused(problem)
    # Straight into the sink's own tensors where they fit (not for an atomic update: nothing is loaded before
    # the whole of it is in).
    destination = None if atomic else _in_place(target, plan, options, device)
    source = StreamedSource(plan, _received(group, buckets, sent, device, destination or fresh), label)
    stream: Iterator[tuple[str, torch.Tensor]] | list[tuple[str, torch.Tensor]] = named_tensors(source, options)
    if atomic:  # every byte in and checked before the sink sees any of it
        stream = list(stream)
        source.drain()
        _check_trailers(group, version, sent, device, label)
    state["loading"] = not atomic
    target.load(stream)  # what was received in place is there already
    if not atomic:
        source.drain()
        _check_trailers(group, version, sent, device, label)
    return version


def _in_place(target: Sink, plan: WeightPlan, options: WeightOptions, device: torch.device) -> Any:
    """Where a module sink's own tensors can take the pieces as they arrive (no copy on the receiver): the stream
    names the plan's tensors as the module does (no renames, merges or splits) in their own dtype, and the module's
    tensor is contiguous, of that dtype and shape, on the group's device. None where nothing can."""
    if not isinstance(target, ModuleSink) or options.quantize is not None or options.dtype != "source":
        return None
    if options.names != "module" and (plan.adapters or has_autoep_names(plan.by_name)):
        return None
    if options.names == "files" and hf_expert_splits((plan.model_config or {}).get("model_type")):
        return None
    ours = {}
    for tensor_plan in plan.tensors:
        found = target.targets.get(tensor_plan.name)
        if (found is not None and found.is_contiguous() and found.dtype == tensor_plan.dtype
                and tuple(found.shape) == tuple(tensor_plan.layout.shape) and found.device == device):
            ours[tensor_plan.name] = found.data
    if not ours:
        return None

    def destination(tensor_plan: TensorPlan) -> torch.Tensor:
        found = ours.get(tensor_plan.name)
        return found if found is not None else torch.empty(tensor_plan.layout.shape, dtype=tensor_plan.dtype,
                                                           device=device)
    return destination


def _kept(group: WeightGroup) -> str:
    return ("the sink keeps what it held" if group.applied_version is None else
            f"the sink keeps version {group.applied_version}")


def _received(group: WeightGroup, buckets: list[Bucket], sent: dict[int, int], device: torch.device,
              destination: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's full tensors, its pieces received where ``destination(plan)`` puts each tensor; the next
    bucket's receives are posted before this one's tensors are handed out."""
    landings: list[Landing] = []
    for index, bucket in enumerate(buckets):
        landings.append(Landing(bucket, destination, group.broadcast, scratch=group.scratch[index % len(group.scratch)]))
        for owner in bucket.owners:
            sent[owner] = sent.get(owner, 0) + bucket.nbytes(owner)
        if len(landings) > _LOOKAHEAD:
            yield landings.pop(0).finish()
    while landings:
        yield landings.pop(0).finish()


def _check_trailers(group: WeightGroup, version: int, received: dict[int, int], device: torch.device,
                    label: str) -> None:
    trailers = {sender: torch.empty(3, dtype=torch.int64, device=device) for sender in range(group.senders)}
    works = [group.broadcast(sender, trailer) for sender, trailer in trailers.items()]
    for work in works:
        work.wait()
    for sender, trailer in trailers.items():
        magic, sent_version, sent = (int(v) for v in trailer.cpu())
        if magic != _TRAILER or sent_version != version or sent != received.get(sender, 0):
            raise CheckpointError(f"{label}: training rank {sender} ended it with {sent} bytes of version "
                                  f"{sent_version}, {received.get(sender, 0)} bytes arrived: a partial update, refused")
