"""The process groups a weight update travels over, apart from the training job's own.

Training ranks and inference processes are separate jobs: the receivers are not in DeepSpeed's world and must
not be (its data-parallel groups are the world). So a :class:`WeightGroup` builds its own groups over a TCP store:
one per training rank, holding that rank and every receiver, in which the training rank broadcasts what it holds.
Each training rank sends on its own connections, at the same time as the others; none gathers for another.

torch builds such groups with its backend classes (``ProcessGroupGloo``, ``ProcessGroupNCCL``) over a
``PrefixStore``: public names of ``torch.distributed``, but a lower layer than ``new_group``. They are used here
alone, checked up front (:func:`_backend_class`).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.weights.plan import Scratch

BACKENDS = ("gloo", "nccl")
#: Threads of each gloo group (see :meth:`WeightGroup._make`).
GLOO_THREADS = 8
#: The store's keys of one group, under the store shared by all.
_PREFIX = "deepspeed_ext/weights/sender{}"


def _backend_class(backend: str) -> Any:
    import torch.distributed as dist
    names = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL"}
    if backend not in names:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    found = getattr(dist, names[backend], None)
    if found is None or not hasattr(dist, "PrefixStore") or not hasattr(dist, "TCPStore"):
        raise CheckpointError(f"this torch ({torch.__version__}) has no torch.distributed.{names[backend]} / "
                              "PrefixStore / TCPStore, which weight streams build their groups with")
    return found


class WeightGroup:
    """The groups between ``senders`` training ranks and ``receivers`` inference processes (see the module).

    A training rank joins as ``rank`` (its rank in the training job); receiver ``receiver`` (0 ..
    ``receivers - 1``) joins with ``receiver=``. Training rank 0 hosts the store at ``host:port``; the others
    connect to it, waiting up to ``timeout`` seconds, which also bounds every later wait for a peer."""

    def __init__(self, host: str, port: int, *, senders: int, receivers: int = 1, rank: int | None = None,
                 receiver: int | None = None, backend: str = "gloo", timeout: float = 300.0):
        import torch.distributed as dist
        if (rank is None) == (receiver is None):
            raise ValueError("a WeightGroup member is a training rank (rank=) or a receiver (receiver=), one of them")
        if senders < 1 or receivers < 1:
            raise ValueError(f"senders={senders}, receivers={receivers}: each must be at least 1")
        if rank is not None and not 0 <= rank < senders:
            raise ValueError(f"rank={rank} is not a training rank of {senders}")
        if receiver is not None and not 0 <= receiver < receivers:
            raise ValueError(f"receiver={receiver} is not one of {receivers} receivers")
        group_class = _backend_class(backend)
        self.senders, self.receivers, self.rank, self.receiver = senders, receivers, rank, receiver
        self.backend, self.timeout = backend, datetime.timedelta(seconds=timeout)
        #: The version of the last update sent (a training rank) or seen (a receiver), and the last one applied.
        self.last_version: int | None = None
        self.applied_version: int | None = None
        self.broken: str | None = None
        #: A receiver's last update header, ``(its text, parsed, the plan)``: the next update's is the same as a
        #: rule, and reusing it keeps the plan's buckets and messages, worked out once.
        self.received_plan: tuple[bytes, Any, Any] | None = None
        #: A receiver's buffers for shards received apart, kept between updates (one per bucket in flight).
        self.scratch = tuple(Scratch() for _ in range(3))
        try:
            self._store = getattr(dist, "TCPStore")(host, port, is_master=rank == 0, timeout=self.timeout,
                                        wait_for_workers=False)
        except Exception as exc:  # torch's store errors run over several lines
            raise CheckpointError(f"weight group at {host}:{port}: cannot reach the store: "
                                  f"{' '.join(str(exc).split())[:300]}") from exc
        members = range(senders) if rank is None else [rank]
        self._groups: dict[int, Any] = {}
        for sender in members:
            store = getattr(dist, "PrefixStore")(_PREFIX.format(sender), self._store)
            own = 0 if rank is not None else 1 + int(receiver or 0)
            self._groups[sender] = self._make(group_class, store, own, 1 + receivers)

    def _make(self, group_class: Any, store: Any, rank: int, size: int) -> Any:
        if self.backend == "gloo":
            # gloo runs a group's collectives on its own threads, two unless told: an update's messages (a hundred
            # or more a rank) then go two at a time, and each one's round trip shows. More threads keep more of them
            # on the wire: at 246M TP=2, a rank's 130 pieces sent bare took 0.26 s with two threads, 0.14-0.18 s
            # with eight (bench/weight_stream.py, loopback; 4 and 16 measured alike). Options are a private class
            # of torch's; without it, the default group.
            options_class = getattr(group_class, "_Options", None)
            if options_class is None or not hasattr(group_class, "create_default_device"):
                return group_class(store, rank, size, self.timeout)
            options = options_class()
            options._timeout = self.timeout
            options._threads = GLOO_THREADS
            options._devices = _gloo_devices(group_class)
            return group_class(store, rank, size, options)
        options = group_class.Options()
        options._timeout = self.timeout
        return group_class(store, rank, size, options)

    @property
    def is_sender(self) -> bool:
        return self.rank is not None

    @property
    def device(self) -> torch.device:
        """Where the buffers of this group's collectives must be."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, sender: int, tensor: torch.Tensor) -> Any:
        """Start the broadcast of ``tensor`` from training rank ``sender`` to the receivers (its own group);
        returns the work to wait on."""
        if self.broken is not None:
            raise CheckpointError(f"weight group: {self.broken}; make a new group")
        return self._groups[sender].broadcast([tensor], _root_options())

    def close(self, reason: str | None = None) -> None:
        """Give the groups up (a failed update: the peers' waits end with an error instead of hanging)."""
        if reason is not None and self.broken is None:
            self.broken = reason
        for group in self._groups.values():
            abort = getattr(group, "abort", None) or getattr(group, "shutdown", None)
            if callable(abort):
                try:
                    abort()
                except Exception:  # the group is already down: nothing more to release
                    pass
        self._groups.clear()


def _gloo_devices(group_class: Any) -> list[Any]:
    """The network devices torch's own gloo groups would use: one per interface ``GLOO_SOCKET_IFNAME`` names (a host
    with several networks, where the hostname does not resolve to the one the peers reach), else the default."""
    import os
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if names:
        return [group_class.create_device(interface=name) for name in names]
    return [group_class.create_default_device()]


def _root_options() -> Any:
    import torch.distributed as dist
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options
