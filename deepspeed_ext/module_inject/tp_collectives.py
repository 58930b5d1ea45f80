"""The TP collectives of the layers deepspeed-ext cuts itself (LoRA adapters, linear-attention heads), as autograd
functions and module hooks: entering the TP region (identity forward, gradient summed), a sum over the TP ranks
(summed forward, gradient unchanged), a replicated parameter's partial gradient summed, and a tensor as TP rank 0
holds it (the ranks agree before they cut)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.checkpoint.engine_private.autotp_hook import collective_device

__all__ = ["EnterTP", "GradSummedOverTP", "InputEntersTP", "OutputSummedOverTP", "SumOverTP", "from_first_rank"]


class EnterTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP ranks (each rank's part of it is partial)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumOverTP(torch.autograd.Function):
    """The sum over the TP ranks forward; the gradient passes unchanged (the sum is the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class InputEntersTP:
    """A forward pre-hook: the module's first input enters the TP region."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (EnterTP.apply(args[0], self.group), *args[1:])  # type: ignore[no-untyped-call]


class HiddenStatesEnterTP:
    """A forward pre-hook (with keyword arguments): a decoder sub-layer's ``hidden_states``, given by position or
    by keyword, enters the TP region."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (EnterTP.apply(args[0], self.group), *args[1:]), kwargs  # type: ignore[no-untyped-call]
        kwargs = dict(kwargs, hidden_states=EnterTP.apply(kwargs["hidden_states"], self.group))  # type: ignore[no-untyped-call]
        return args, kwargs


class OutputSummedOverTP:
    """A forward hook: the module's output summed over the TP ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        summed: torch.Tensor = SumOverTP.apply(output, self.group)  # type: ignore[no-untyped-call]
        return summed


class GradSummedOverTP:
    """A tensor hook: a replicated parameter's partial gradient summed over the TP ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=self.group)
        return grad


def from_first_rank(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` as TP rank 0 holds it (a copy, on ``tensor``'s device)."""
    device = collective_device(group, tensor.device)
    moved = tensor.detach().to(device, copy=True).contiguous()
    dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group)
    return moved.to(tensor.device)
