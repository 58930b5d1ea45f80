"""End-to-end scenarios: the real DeepSpeed engine under torchrun (gloo, CPU), trained once per test run and
shared by the workers (``shared_scenario``; the ``scenarios`` fixture in tests/e2e/conftest.py)."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.runner import cli, read_loss_scales, read_losses, run_logged, torchrun_train, torchrun_train_runs


@dataclass(frozen=True)
class Load:
    """One ``Scenario.loaded``: ``load_dir`` loaded at TP×DP (``extra``: more train.py arguments)."""

    tp: int
    dp: int
    load_dir: Path
    load_universal: bool = True
    extra: tuple[str, ...] = ()


#: A resumed run builds its model from other initial weights than the run that saved: the checkpoint must supply
#: every weight (a frozen one left out would otherwise still hold the saved run's initial value).
RESUMED_INIT = ["--init-seed", "4321"]


@dataclass
class Scenario:
    """Train (saving at ``save_at``, dumping the live engine's state) → convert → resume on demand."""

    root: Path
    tp: int
    dp: int = 1
    zero: int = 1
    dtype: str = "bf16"
    plain: bool = False  # deepspeed.initialize without our section: only upstream's tags
    grad_accum: int = 1
    family: str = "llama"
    grad_accum_dtype: str | None = None  # "fp32" with bf16 + ZeRO-1 selects DeepSpeed's BF16_Optimizer
    fused_adam: bool = False  # DeepSpeed's FusedAdam instead of torch's Adam
    kv_heads: int = 4  # 2: TP=3/4 ranks beyond the KV-head count hold empty attention shards
    ep: int = 0  # DeepSpeed AutoEP's expert-parallel degree for an MoE family (0: off)
    optimizer: str = "adam"  # the demo's --optimizer: adam, muon, adagrad (DeepSpeed's) or sgd (a client's)
    python: str = sys.executable  # the environment (DeepSpeed version) that trains, converts and resumes
    model_config: dict | None = None  # an HF config.json's values instead of the family's tiny config
    steps: int = 5
    save_at: int = 3
    warmup_steps: int = 0  # DeepSpeed's WarmupLR over that many steps (0: a constant rate)
    save_also: tuple[int, ...] = ()  # more steps to save after (``tag_dir`` stays ``save_at``'s; convert=False)
    freeze: str | None = None  # the demo's --freeze: a regular expression of parameter names trained by no optimizer
    lora: int = 0  # the demo's --lora: peft LoRA adapters of this rank on a frozen base (0: the whole model trains)
    lora_targets: str = "all-linear"  # the demo's --lora-targets
    lora_options: str = "{}"  # the demo's --lora-options (more LoraConfig settings, JSON)
    gradient_clipping: str | None = None  # the demo's --gradient-clipping (None: its default, 1.0; "unset": left out)
    baseline: dict[int, float] = field(default_factory=dict)
    resumed: dict[tuple, dict[int, float]] = field(default_factory=dict)
    #: fp16 loss scale per step: "baseline" for the uninterrupted run, else the resume's key.
    loss_scales: dict[object, dict[int, float | None]] = field(default_factory=dict)

    @property
    def save_dir(self) -> Path:
        return self.root / "ckpt"

    @property
    def tag_dir(self) -> Path:
        return self.save_dir / f"global_step{self.save_at}"

    @property
    def universal_dir(self) -> Path:
        return self.save_dir / f"global_step{self.save_at}_universal"

    @property
    def dump_dir(self) -> Path:
        return self.root / "live"

    def common(self, tp: int) -> list[str]:
        if self.model_config is not None:
            path = self.root / "model_config.json"
            path.write_text(json.dumps(self.model_config))
            return self._common(tp) + ["--model-config", str(path)]
        return self._common(tp)

    def _common(self, tp: int) -> list[str]:
        return ["--tp", str(tp), "--zero", str(self.zero), "--dtype", self.dtype, "--steps", str(self.steps),
                "--grad-accum", str(self.grad_accum), "--family", self.family, "--kv-heads", str(self.kv_heads)] + (
                    ["--grad-accum-dtype", self.grad_accum_dtype] if self.grad_accum_dtype else []) + (
                        ["--fused-adam"] if self.fused_adam else []) + (
                            ["--allow-cpu-fp16"] if self.dtype == "fp16" else []) + (
                                ["--ep", str(self.ep)] if self.ep else []) + (
                                    ["--optimizer", self.optimizer] if self.optimizer != "adam" else []) + (
                                        ["--warmup-steps", str(self.warmup_steps)] if self.warmup_steps else []) + (
                                            ["--freeze", self.freeze] if self.freeze else []) + (
                                                ["--gradient-clipping", self.gradient_clipping]
                                                if self.gradient_clipping else []) + (
                                                    ["--lora", str(self.lora), "--lora-targets", self.lora_targets,
                                                     "--lora-options", self.lora_options] if self.lora else [])

    def train(self) -> Scenario:
        args = self.common(self.tp) + ["--save-dir", str(self.save_dir), "--save-at", str(self.save_at), "--result",
                                       str(self.root / "baseline.json"), "--dump", str(self.dump_dir)]
        for step in self.save_also:
            args += ["--save-at", str(step)]
        torchrun_train(self.tp * self.dp,
                       args + (["--plain"] if self.plain else []),
                       self.root / "train.log",
                       python=self.python)
        return self.read_baseline()

    def spec(self) -> str:
        """What the run is (every parameter but where it lives and what it has found), as text: two scenarios
        with equal specs train the same run, however their parameters were spelled."""
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if f.name not in ("root", "baseline", "resumed", "loss_scales")}, sort_keys=True)

    def read_baseline(self) -> Scenario:
        """The uninterrupted run's losses and loss scales, from what ``train`` left in ``root``."""
        result = self.root / "baseline.json"
        self.baseline = read_losses(result)
        self.loss_scales["baseline"] = read_loss_scales(result)
        return self

    def convert(self) -> Scenario:
        cli(["to-universal", str(self.save_dir), "--quiet"], self.root / "convert.log", python=self.python)
        return self

    def resume(self,
               tp: int,
               dp: int = 1,
               load_dir: Path | None = None,
               upstream: bool = False,
               zero: int | None = None) -> dict[int, float]:
        """Resume at TP×DP (and ZeRO stage ``zero``, default the saved one) from ``load_dir`` (default: our
        universal output); ``upstream``: plain DeepSpeed restores."""
        key = (tp, dp, str(load_dir), upstream, zero)  # resumed_loss_scales() rebuilds this key
        if key not in self.resumed:
            name = f"resume_tp{tp}_dp{dp}" + ("_upstream" if upstream else "") + f"_{len(self.resumed)}"
            args = self.common(tp) + ["--load-dir", str(load_dir or self.save_dir), "--result",
                                      str(self.root / f"{name}.json"), *RESUMED_INIT]
            if zero is not None:
                args += ["--zero", str(zero)]
            torchrun_train(tp * dp,
                           args + (["--plain"] if upstream else []),
                           self.root / f"{name}.log",
                           python=self.python)
            self.resumed[key] = read_losses(self.root / f"{name}.json")
            self.loss_scales[key] = read_loss_scales(self.root / f"{name}.json")
        return self.resumed[key]

    def loaded(self, tp: int, dp: int, load_dir: Path, load_universal: bool = True, extra: tuple[str, ...] = ()
               ) -> tuple[list[dict[str, dict[str, torch.Tensor]]], dict[int, float]]:
        """Load ``load_dir`` at TP×DP (``extra``: more train.py arguments), dump every TP rank's state right after
        ``load_checkpoint``, train one step: (per TP rank {param: {fp32, exp_avg, exp_avg_sq}}, {step: loss})."""
        return self.loaded_many([Load(tp, dp, load_dir, load_universal, extra)])[0]

    def loaded_many(self, loads: list[Load]) -> list[tuple[list[dict[str, dict[str, torch.Tensor]]], dict[int, float]]]:
        """``loaded`` for each of ``loads``, those at one TP×DP in one torchrun (a fresh engine each)."""
        names = []
        for load in loads:
            names.append(f"loaded_tp{load.tp}_dp{load.dp}_{load.load_dir.name}" +
                         ("" if load.load_universal else "_native_config") +
                         "".join(f"_{arg.strip('-')}" for arg in load.extra))
        groups: dict[tuple[int, int], list[int]] = {}
        for index, load in enumerate(loads):
            groups.setdefault((load.tp, load.dp), []).append(index)
        for (tp, dp), indices in groups.items():
            runs = []
            for index in indices:
                load, name = loads[index], names[index]
                runs.append(self.common(tp) + list(load.extra) + RESUMED_INIT +
                            ["--load-dir", str(load.load_dir), "--dump-loaded", str(self.root / name), "--steps",
                             str(self.save_at + 1), "--result", str(self.root / f"{name}.json")] +
                            ([] if load.load_universal else ["--no-load-universal"]))
            log = names[indices[0]] + (f"_and_{len(indices) - 1}_more" if len(indices) > 1 else "")
            torchrun_train_runs(tp * dp, runs, self.root / f"{log}.log", python=self.python)
        return [([torch.load(self.root / name / f"tp_rank_{r:02d}.pt", weights_only=True) for r in range(load.tp)],
                 read_losses(self.root / f"{name}.json")) for load, name in zip(loads, names)]

    def resumed_loss_scales(self, tp: int, dp: int = 1, zero: int | None = None) -> dict[int, float | None]:
        """The loss scales of the resume ``resume(tp, dp, zero=zero)`` ran (from our universal output)."""
        return self.loss_scales[(tp, dp, "None", False, zero)]

    def live_experts(self, directory: Path | None = None) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """AutoEP: per EP rank, its experts' fp32 / exp_avg / exp_avg_sq as DeepSpeed reported them at save time
        (``directory``: a ``loaded`` dump instead)."""
        found: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for path in sorted((directory or self.dump_dir).glob("experts_rank_*.pt")):
            dump = torch.load(path, weights_only=True)
            found.setdefault(int(dump["ep_rank"]), dump["state"])
        return found

    def live_state(self) -> list[dict[str, dict[str, torch.Tensor]]]:
        """Per TP rank, the TP-local fp32 / exp_avg / exp_avg_sq DeepSpeed itself reported at save time."""
        return [torch.load(self.dump_dir / f"tp_rank_{r:02d}.pt", weights_only=True) for r in range(self.tp)]


def scenario_cache_dir(basetemp: Path) -> Path:
    """Where a test run keeps its trained scenarios: beside the workers' own base directories (pytest-xdist gives
    each worker ``<the run's basetemp>/popen-gwN``), so every worker of one run finds them and no other run does."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "trained-scenarios"


def shared_scenario(name: str, root: Path, cache: Path, convert: bool = True, **kwargs) -> Scenario:
    """``Scenario(root, **kwargs)`` trained (and converted), trained once per test run whichever worker asks.

    The first worker to ask trains it in its own ``root`` and publishes a copy, as it was before any test used it,
    to ``cache`` (a staging copy renamed into place); a worker asking meanwhile waits on the scenario's file lock,
    then copies the published one into its own ``root``. Each worker has a private copy, as when each trained its
    own: tests may write beside or into it (an ``--overwrite`` conversion, resume logs) without racing another
    worker. ``root`` is an empty directory of this worker's."""
    spec = json.dumps({"name": name, "convert": convert}) + "\n" + Scenario(root, **kwargs).spec()
    key = f"{name}-{hashlib.sha1(spec.encode()).hexdigest()[:12]}"
    published = cache / key
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if training fails
        if published.is_dir():
            shutil.copytree(published, root, symlinks=True, dirs_exist_ok=True)
            return Scenario(root=root, **kwargs).read_baseline()
        scenario = Scenario(root=root, **kwargs).train()
        if convert:
            scenario.convert()
        staging = cache / f"{key}.partial-{os.getpid()}"
        shutil.copytree(root, staging, symlinks=True)
        staging.rename(published)
        (cache / f"{key}.json").write_text(spec)  # which parameters the key stands for, for whoever looks
        return scenario


def geometry(family: str, *, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    """The family's tiny training config (an HF config's values, for ``Scenario.model_config``) with another
    geometry: ``layers`` decoder layers, ``heads`` query heads of ``head_dim`` (the hidden size follows), and
    ``kv_heads`` KV heads. The default tiny geometry has 2 layers at TP=2 and head_dim 4 == 4 KV heads, so a
    swapped stack axis and head axis, or a layer index taken for a TP rank, would pass there unnoticed."""
    from deepspeed_ext.demo.models import tiny_config
    values = tiny_config(family, kv_heads).to_dict()
    values.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, hidden_size=heads * head_dim)
    for key in ("transformers_version", "dtype", "torch_dtype", "architectures", "layer_types", "id2label", "label2id"):
        values.pop(key, None)
    return values


#: Geometries where no two of layers, KV heads, head_dim and the TP degree trained at are equal (and head_dim a
#: power of 4, so MaxText's pre-scaled query kernel round-trips exactly): 5 layers, 2 KV heads, head_dim 16 at
#: TP=3; 3 layers, 2 KV heads, head_dim 8 at TP=4. Fewer KV heads than TP ranks in both.
GEOMETRY_TP3 = dict(layers=5, heads=4, kv_heads=2, head_dim=16)
GEOMETRY_TP4 = dict(layers=3, heads=8, kv_heads=2, head_dim=8)

#: Tiny models with 2 KV heads: at TP=3 and TP=4 the ranks beyond the head count hold empty attention shards.
#: Shared by the test files that use them (the run trains each once: ``shared_scenario``). The TP=3 and TP=4 ones
#: also have geometries of their own (above).
KV2_SCENARIOS = {
    "kv2_llama_tp2": dict(tp=2, kv_heads=2),
    "kv2_llama_tp3": dict(tp=3, kv_heads=2, model_config=geometry("llama", **GEOMETRY_TP3)),
    "kv2_llama_tp4": dict(tp=4, kv_heads=2, model_config=geometry("llama", **GEOMETRY_TP4)),
    "kv2_qwen3_tp2": dict(tp=2, kv_heads=2, family="qwen3"),
    "kv2_qwen3_tp3": dict(tp=3, kv_heads=2, family="qwen3", model_config=geometry("qwen3", **GEOMETRY_TP3)),
    "kv2_llama_tp2_zero3": dict(tp=2, kv_heads=2, zero=3),
    # no ZeRO: FP16_UnfusedOptimizer, per-rank order
    "kv2_llama_tp3_zero0": dict(tp=3, kv_heads=2, zero=0, model_config=geometry("llama", **GEOMETRY_TP3)),
}


def without_commit_marker(tag_dir: Path) -> Path:
    """``tag_dir`` (a copy) made as an earlier deepspeed-ext saved it, without a commit marker, so that a test may
    edit its files and reach the reader's own checks of them (with the marker, any edit is a file that differs
    from it)."""
    import json

    from deepspeed_ext.checkpoint import commit
    (tag_dir / commit.COMMIT_FILE).unlink(missing_ok=True)
    info_file = tag_dir / commit.UC_INFO_FILE
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        info.pop(commit.UC_INFO_KEY, None)
        info_file.write_text(json.dumps(info))
    return tag_dir


def without_recorded_order(tag_dir: Path, copy: Path) -> Path:
    """A copy of a stage-0 tag directory whose deepspeed_ext.json lacks the recorded optimizer parameter order,
    as an older deepspeed-ext (or upstream's tags alone) would leave it."""
    import json
    import shutil

    from deepspeed_ext.checkpoint.metadata import METADATA_FILE
    shutil.copytree(tag_dir, copy)
    without_commit_marker(copy)
    info = json.loads((copy / METADATA_FILE).read_text())
    assert info.pop("optimizer_param_names")
    (copy / METADATA_FILE).write_text(json.dumps(info))
    return copy


def assert_losses_continue(scenario: Scenario, resumed: dict[int, float], rel: float = 1e-2) -> None:
    assert sorted(resumed) == list(range(scenario.save_at + 1, scenario.steps + 1)), resumed
    for step, loss in resumed.items():
        base = scenario.baseline[step]
        assert abs(loss - base) <= rel * abs(base), f"step {step}: resumed loss {loss} vs uninterrupted {base}"


def assert_universal_matches_live(scenario: Scenario, optimizer_steps: int | None = None) -> int:
    """Each merged tensor, cut back with the source layout, equals every rank's live shard bit for bit,
    and the optimizer step is ``optimizer_steps`` (default: the global step saved at)."""
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    universal = UniversalCheckpoint(scenario.universal_dir)
    layouts = DeepSpeedCheckpoint(scenario.tag_dir).layouts
    live = scenario.live_state()
    assert sorted(universal.names) == sorted(live[0]) == sorted(layouts)
    compared = 0
    for name, layout in layouts.items():
        # Every state the live optimizer keeps for the parameter (Adam's moments, Muon's or SGD's momentum, ...),
        # in the dtype it keeps it (DeepSpeed's Muon keeps its ZeRO-1/2 momentum in the gradients' bf16).
        tensor_states, scalars = universal.states_of(name)
        assert sorted(tensor_states) == sorted(live[0][name]), (name, tensor_states, sorted(live[0][name]))
        for state in tensor_states:
            full = universal.load(name, state)
            assert full.dtype == live[0][name][state].dtype and tuple(full.shape) == layout.shape, (
                name, state, full.dtype, full.shape)
            for rank in range(scenario.tp):
                expected = live[rank][name][state]
                got = layout.slice(full, rank)
                assert torch.equal(got, expected), f"{name}/{state}: TP rank {rank} differs from the live engine"
                compared += 1
        if "step" in scalars:
            step = universal.step(name)
            assert int(step) == (scenario.save_at if optimizer_steps is None else optimizer_steps), (name, step)
    return compared


def upstream_ds_to_universal(tag_dir: Path, out: Path, *options: str) -> Path:
    """Upstream's own converter (``python -m deepspeed.checkpoint.ds_to_universal``) on ``tag_dir``; ``options``:
    more of its options (``--inject_missing_state`` for a checkpoint of a model without AutoTP metadata)."""
    run_logged([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1", *options],
               out.with_name(out.name + ".log"))
    return out


#: Keys our universal files carry where upstream's converter writes none, each with why upstream's loader reads
#: the file the same. ``cat_dim``: upstream 0.19.8 writes it only on its non-AutoTP path; its AutoTP loader takes the
#: slice from the live parameter's restore metadata and never reads it, and its legacy loader (a model without that
#: metadata, as under DeepSpeed 0.18.8) needs it to chunk a row-parallel weight along dim 1 instead of dim 0.
EXTRA_KEYS_UPSTREAM_READS_THE_SAME = {"cat_dim"}
#: What ``zero/optimizer_state.pt`` leaves out of upstream's on purpose (docs/universal-checkpoints.md): from ZeRO-3,
#: rank 0's flat fp32 partition and its moments, which the per-parameter files hold already and upstream's loader
#: never reads there (it reads the step and the hyper-parameters, which ours keeps).
OPTIMIZER_STATE_LEFT_OUT = {"fp32_flat_groups", "optimizer_state_dict.state.*.exp_avg",
                            "optimizer_state_dict.state.*.exp_avg_sq"}


def _plain(value: Any) -> Any:
    """A value as compared: tensors by their bits, DeepSpeed's objects by their attributes."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype, value.tolist() if value.numel() <= 16 else None)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value).__name__, _plain(vars(value)))
    return value


def _optimizer_state_differences(ours: Any, theirs: Any, where: str, diffs: list[str]) -> None:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs), key=str):
            here = f"{where}.{key}" if where else str(key)
            pattern = re.sub(r"\.\d+\.", ".*.", here)
            if here in OPTIMIZER_STATE_LEFT_OUT or pattern in OPTIMIZER_STATE_LEFT_OUT:
                continue
            if key not in ours or key not in theirs:
                holder = "ours" if key in ours else "upstream's"
                diffs.append(f"optimizer_state.pt: {here} only in {holder}")
            else:
                _optimizer_state_differences(ours[key], theirs[key], here, diffs)
    elif _plain(ours) != _plain(theirs):
        diffs.append(f"optimizer_state.pt: {where} is {_plain(ours)!r} in ours, {_plain(theirs)!r} in upstream's")


def differences_from_upstream(ours: Path, upstream: Path, only_ours: tuple[str, ...] = ()) -> list[str]:
    """Where two universal checkpoints differ: parameter names (``only_ours``: those upstream leaves out, as the
    frozen ones), each file's form (upstream's bare flat tensor from ZeRO-3 at TP=1, else a dictionary), its keys
    and values, the tensors' bits, which parameters have a ``step.pt`` and its value, and
    ``zero/optimizer_state.pt`` but for :data:`OPTIMIZER_STATE_LEFT_OUT`."""
    from deepspeed_ext.checkpoint import serialization
    names = sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir())
    theirs_names = sorted(p.name for p in (upstream / "zero").iterdir() if p.is_dir())
    diffs = [f"{name}: only in ours" for name in names if name not in theirs_names and name not in only_ours]
    diffs += [f"{name}: only upstream's" for name in theirs_names if name not in names]
    for name in (n for n in names if n in theirs_names):
        files = {d: sorted(p.name for p in (d / "zero" / name).iterdir()) for d in (ours, upstream)}
        if files[ours] != files[upstream]:
            diffs.append(f"{name}: files {files[ours]} in ours, {files[upstream]} in upstream's")
        for file in (f for f in files[ours] if f in files[upstream]):
            entry = serialization.load(ours / "zero" / name / file)
            theirs = serialization.load(upstream / "zero" / name / file)
            if isinstance(entry, dict) != isinstance(theirs, dict):
                diffs.append(f"{name}/{file}: {type(entry).__name__} in ours, {type(theirs).__name__} in upstream's")
                continue
            if file == "step.pt":
                if float(entry) != float(theirs):
                    diffs.append(f"{name}/step: ours {entry}, upstream {theirs}")
                continue
            a, b = (entry["param"], theirs["param"]) if isinstance(entry, dict) else (entry, theirs)
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                diffs.append(f"{name}/{file}: ours {tuple(a.shape)} {a.dtype}, upstream {tuple(b.shape)} {b.dtype}")
            if not isinstance(entry, dict):
                continue
            # The file level: every key upstream writes, with upstream's value (cat_dim, vocab_tensor, ...).
            for key in sorted(set(theirs) - {"param"}):
                if key not in entry or entry[key] != theirs[key]:
                    diffs.append(f"{name}/{file}: {key} is {entry.get(key, 'missing')!r} in ours, "
                                 f"{theirs[key]!r} in upstream's")
            diffs += [f"{name}/{file}: {key} only in ours" for key in sorted(set(entry) - set(theirs))
                      if key not in EXTRA_KEYS_UPSTREAM_READS_THE_SAME]
    _optimizer_state_differences(serialization.load(ours / "zero" / "optimizer_state.pt"),
                                 serialization.load(upstream / "zero" / "optimizer_state.pt"), "", diffs)
    return diffs
