"""``deepspeed-ext compare A B``: two checkpoints of any formats, tensor by tensor and state by state.

Every reader yields its parameters under the Hugging Face names (the family registry maps MaxText's layout back
to them; DeepSpeed and universal checkpoints of transformers models carry them already), so any two sources line
up by name. For each tensor and state both have: shapes, dtypes, the largest absolute and relative difference,
and the largest difference in units in the last place (ulp) of the lower of the two precisions (both sides
rounded to it first, so a bf16 model's fp32 master and the bf16 weights written from it are 0 ulp apart). One
pair of tensors is in memory at a time, compared in chunks.

An element is within tolerance when it is at most ``ulp`` ulps away, or when ``|a - b| <= atol + rtol * |b|``.
The defaults (0, 0, 0) ask for equality in the lower precision; a round trip through MaxText's layout rounds
once or twice per element (``--ulp 2``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from deepspeed_ext.checkpoint.source import MASTER_WEIGHTS, CheckpointSource
from deepspeed_ext.checkpoint.tensor import LogicalTensor

#: Elements compared per chunk: the temporaries stay at a few hundred MiB whatever the tensor's size.
CHUNK_ELEMENTS = 1 << 22
#: Integer views that order floats of each width by value (for ulp distances).
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.0
    rtol: float = 0.0
    ulp: int = 0


@dataclass
class StateDiff:
    """One tensor state compared."""

    name: str
    state: str
    shape_a: list[int]
    shape_b: list[int]
    dtype_a: str
    dtype_b: str
    #: Compared in this precision (the lower of the two) for ulps.
    precision: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int = 0
    #: Elements beyond the tolerance.
    beyond: int = 0
    ok: bool = True
    note: str = ""

    def describe(self) -> str:
        if self.note:
            return f"{self.name} {self.state}: {self.note}"
        return (f"{self.name} {self.state}: max |a-b| {self.max_abs:.3g}, max rel {self.max_rel:.3g}, "
                f"max {self.max_ulp} ulp ({self.precision}); {self.beyond} element(s) beyond tolerance")


@dataclass
class CompareReport:
    a: str
    b: str
    tolerance: Tolerance
    states: list[StateDiff] = field(default_factory=list)
    #: Tensor names only one side has.
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    #: ``state: count`` of tensors whose state only one side has (HF weights have no moments).
    states_only_a: dict[str, int] = field(default_factory=dict)
    states_only_b: dict[str, int] = field(default_factory=dict)
    logits: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        logits_ok = self.logits is None or bool(self.logits.get("ok", True))
        return all(s.ok for s in self.states) and not self.only_a and not self.only_b and logits_ok

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "ok": self.ok, "tolerance": asdict(self.tolerance),
                "compared": len(self.states), "beyond": sum(not s.ok for s in self.states),
                "only_in_a": self.only_a, "only_in_b": self.only_b,
                "states_only_in_a": self.states_only_a, "states_only_in_b": self.states_only_b,
                "states": [asdict(s) for s in self.states], "logits": self.logits}

    def lines(self) -> list[str]:
        tol = self.tolerance
        bad = [s for s in self.states if not s.ok]
        tensors = len({s.name for s in self.states})
        out = [f"A: {self.a}", f"B: {self.b}",
               f"compared {len(self.states)} states of {tensors} tensors: {len(self.states) - len(bad)} within "
               f"tolerance, {len(bad)} beyond (atol={tol.atol:g}, rtol={tol.rtol:g}, ulp={tol.ulp})"]
        out += [f"BEYOND {s.describe()}" for s in bad]
        if self.states:
            worst = max(self.states, key=lambda s: (s.max_ulp, s.max_abs))
            out.append(f"largest difference: {worst.describe()}")
        for side, names in (("A", self.only_a), ("B", self.only_b)):
            if names:
                shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                out.append(f"only in {side} ({len(names)}): {shown}")
        for side, counts in (("A", self.states_only_a), ("B", self.states_only_b)):
            for state, count in counts.items():
                out.append(f"not compared: {state} of {count} tensors, only in {side}")
        if self.logits is not None:
            out.append(f"logits: {self.logits['summary']}")
        out.append("OK: within tolerance" if self.ok else "DIFFERENT")
        return out


def compare_sources(a: CheckpointSource, b: CheckpointSource, tolerance: Tolerance = Tolerance(),
                    progress: bool = False) -> CompareReport:
    """Compare every tensor and state ``a`` and ``b`` both have; one pair of tensors in memory at a time."""
    from tqdm import tqdm

    from deepspeed_ext.checkpoint.expert_names import has_autoep_names, model_named
    if has_autoep_names(a.info.layouts) != has_autoep_names(b.info.layouts):
        a, b = model_named(a), model_named(b)  # an AutoEP checkpoint against its HF / MaxText output: the model's names
    report = CompareReport(str(a.info.given), str(b.info.given), tolerance)
    b_tensors = {tensor.name: tensor for tensor in b.tensors()}
    seen = set()
    for tensor in tqdm(a.tensors(), total=len(a.info.layouts), desc="compare", unit="tensor", disable=not progress):
        seen.add(tensor.name)
        other = b_tensors.get(tensor.name)
        if other is None:
            report.only_a.append(tensor.name)
            continue
        for state in tensor.states:
            if state not in other.states:
                report.states_only_a[state] = report.states_only_a.get(state, 0) + 1
                continue
            report.states.append(_compare_state(tensor, other, state, tolerance,
                                                (_held_in(a, tensor, state), _held_in(b, other, state))))
        for state in other.states:
            if state not in tensor.states:
                report.states_only_b[state] = report.states_only_b.get(state, 0) + 1
    report.only_b = [name for name in b_tensors if name not in seen]
    a.raise_if_damaged()  # a difference read from a damaged file says nothing about the training state
    b.raise_if_damaged()
    return report


def _held_in(source: CheckpointSource, tensor: LogicalTensor, state: str) -> torch.dtype | None:
    """The precision a source stores a state in when it hands it out wider: MaxText's bf16 weights come back
    as fp32 (undone from its layout in fp32). None: as loaded."""
    from deepspeed_ext.checkpoint.formats import FORMATS
    fmt = FORMATS.get(source.info.format)
    if fmt is not None and fmt.widens_weights and state == MASTER_WEIGHTS:
        return tensor.dtype
    return None


def _compare_state(a: LogicalTensor, b: LogicalTensor, state: str, tolerance: Tolerance,
                   held_in: tuple[torch.dtype | None, torch.dtype | None] = (None, None)) -> StateDiff:
    if state in a.scalars or state in b.scalars:  # the step, and any other scalar an optimizer keeps
        value_a, value_b = (_number(t.load(state)) for t in (a, b))
        kind = "int" if isinstance(value_a, int) and isinstance(value_b, int) else "float"
        diff = StateDiff(a.name, state, [], [], kind, kind, precision=kind, max_abs=float(abs(value_a - value_b)))
        diff.ok = value_a == value_b
        diff.note = "" if diff.ok else f"{state} {value_a} vs {value_b}"
        return diff
    x, y = a.load_tensor(state).detach(), b.load_tensor(state).detach()
    diff = StateDiff(a.name, state, list(x.shape), list(y.shape), _name(x.dtype), _name(y.dtype))
    if x.shape != y.shape:
        diff.ok, diff.note = False, f"shapes differ: {list(x.shape)} vs {list(y.shape)}"
        return diff
    precisions = [held or value.dtype for held, value in zip(held_in, (x, y), strict=True)]
    # The coarser of the two (bf16 against fp16: the larger epsilon).
    low = max(precisions, key=lambda dtype: (torch.finfo(dtype).eps, -torch.finfo(dtype).bits))
    diff.precision = _name(low)
    for chunk_x, chunk_y in _chunks(x, y):
        _accumulate(diff, chunk_x, chunk_y, low, tolerance)
    diff.ok = diff.beyond == 0
    return diff


def _number(value: Any) -> int | float:
    """A scalar state as a number: an integral value as an int (a step kept in a float tensor is still a count)."""
    number = value.item() if torch.is_tensor(value) else value
    return int(number) if float(number).is_integer() else float(number)


def _chunks(x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    for start in range(0, flat_x.numel(), CHUNK_ELEMENTS):
        yield flat_x[start:start + CHUNK_ELEMENTS], flat_y[start:start + CHUNK_ELEMENTS]


def _accumulate(diff: StateDiff, x: torch.Tensor, y: torch.Tensor, low: torch.dtype, tolerance: Tolerance) -> None:
    wide_x, wide_y = x.to(torch.float64), y.to(torch.float64)
    delta = (wide_x - wide_y).abs()
    both_nan = wide_x.isnan() & wide_y.isnan()
    delta = torch.where(both_nan | (wide_x == wide_y), torch.zeros_like(delta), delta)  # inf == inf: 0
    delta = torch.where(delta.isnan(), torch.full_like(delta, math.inf), delta)
    scale = torch.maximum(wide_x.abs(), wide_y.abs())
    rel = torch.where(delta == 0, torch.zeros_like(delta), delta / scale)
    ulps = _ulp_distance(x.to(low), y.to(low))
    ulps = torch.where(both_nan, torch.zeros_like(ulps), ulps)
    within = (ulps <= tolerance.ulp) | (delta <= tolerance.atol + tolerance.rtol * wide_y.abs())
    if delta.numel():
        diff.max_abs = max(diff.max_abs, float(delta.max()))
        diff.max_rel = max(diff.max_rel, float(rel.nan_to_num(nan=math.inf).max()))
        diff.max_ulp = max(diff.max_ulp, int(ulps.max()))
    diff.beyond += int((~within).sum())


def _ulp_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of their dtype lie between ``x`` and ``y`` (int64)."""
    bits = _BITS[x.element_size()]
    lowest = torch.iinfo(bits).min
    ordered = []
    for value in (x, y):
        raw = value.view(bits).to(torch.int64)
        ordered.append(torch.where(raw < 0, lowest - raw, raw))  # sign-magnitude to two's complement order
    return (ordered[0] - ordered[1]).abs()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


#: The fixed tokens --logits runs (cut to the model's vocabulary): no tokenizer needed.
LOGITS_TOKENS = 32


def logits_report(a: CheckpointSource, b: CheckpointSource) -> dict[str, Any]:
    """transformers' model of each side (its weights, in fp32) on the same fixed tokens: per-token KL(a || b)
    and how often the argmax agrees. Reported, not a pass/fail: the tensors decide the exit status."""
    logits_a, logits_b = (_logits(source) for source in (a, b))
    log_p = torch.log_softmax(logits_a.double(), -1)
    log_q = torch.log_softmax(logits_b.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (logits_a.argmax(-1) == logits_b.argmax(-1)).double().mean()
    result: dict[str, Any] = {"tokens": logits_a.shape[0], "max_kl": float(kl.max()), "mean_kl": float(kl.mean()),
              "argmax_agreement": float(agree)}
    result["summary"] = (f"{result['tokens']} tokens, per-token KL(A||B) max {result['max_kl']:.3g} mean "
                         f"{result['mean_kl']:.3g}, argmax agrees on {result['argmax_agreement']:.1%}")
    return result


def _logits(source: CheckpointSource) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from deepspeed_ext.checkpoint.model_config import hf_config
    from deepspeed_ext.checkpoint.source import MASTER_WEIGHTS, required_model_config
    from deepspeed_ext.errors import CheckpointError
    config = hf_config(required_model_config(source.info), torch.float32, str(source.info.given))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    state = {tensor.name: tensor.load_tensor(MASTER_WEIGHTS).float() for tensor in source.tensors()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    persistent = set(model.state_dict())
    missing = [name for name in missing if name in persistent and name not in _tied(model)]
    if missing or unexpected:
        raise CheckpointError(f"{source.info.given}: does not fit transformers' {type(model).__name__} for --logits "
                              f"(missing {missing[:3]}, unexpected {list(unexpected)[:3]})")
    vocab = int(config.vocab_size)
    tokens = (torch.arange(LOGITS_TOKENS) * 7919 + 11) % vocab
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=tokens[None]).logits[0]
    return logits


def _tied(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier one (a tied LM head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.setdefault(id(param), name)
    return tied
