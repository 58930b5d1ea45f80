"""Blocks read from a checkpoint on their way into an accelerator's tensors: staged in pinned host memory and
copied to the device without blocking, so the restore neither synchronises per tensor nor copies from pageable
memory (which the driver stages through a bounce buffer of its own, synchronously)."""

from __future__ import annotations

import torch


class DeviceStaging:
    """Two pinned buffers taking turns. A block read on the host is copied into the next buffer, then from there
    into the device tensors with ``non_blocking`` copies on the current stream; an event recorded after them tells
    when that buffer may take another block. Reading and staging the next block overlap the last one's copies, and
    host memory stays at two blocks. Kernels that later use the device tensors run on the same stream, after the
    copies: nothing waits on the host but the reuse of a buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.Event | None] = [None, None]
        self._turn = 0

    def stage(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` (a host tensor) in pinned memory, to be copied to the device with ``non_blocking=True``; call
        :meth:`copies_issued` once those copies are queued."""
        turn = self._turn
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copies out of this buffer, two blocks ago
        buffer = self._buffers[turn]
        if buffer is None or buffer.dtype != block.dtype or buffer.numel() < block.numel():
            buffer = torch.empty(block.numel(), dtype=block.dtype, pin_memory=True)
            self._buffers[turn] = buffer
        staged = buffer[:block.numel()].view(block.shape)
        staged.copy_(block)
        return staged

    def copies_issued(self) -> None:
        """The copies out of the buffer :meth:`stage` last filled are queued: mark when they will be done."""
        event = torch.Event(device=self.device)
        event.record()
        self._events[self._turn] = event
        self._turn ^= 1


def staging_for(tensors: list[torch.Tensor]) -> DeviceStaging | None:
    """A :class:`DeviceStaging` where one of ``tensors`` is on an accelerator; None where all are host tensors."""
    device = next((tensor.device for tensor in tensors if tensor.device.type not in ("cpu", "meta")), None)
    return None if device is None else DeviceStaging(device)
