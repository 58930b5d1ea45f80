"""Switching frameworks mid-run, with MaxText's own training code (.venv-maxtext, CPU):

- DeepSpeed TP=2 trains 3 steps (fp32) -> ``to-maxtext --with-optimizer`` -> MaxText restores it as its full train
  state (``load_full_state_path``: parameters, Adam moments, step) and its own ``train_step`` runs step 4 on the
  batch DeepSpeed trained step 4 on: the same loss, and the same updated parameters and moments as DeepSpeed's
  step-4 checkpoint (read back through ``from-maxtext`` from the full state MaxText's checkpoint manager saved).
- MaxText goes on to step 5, saves with its own checkpoint manager -> ``from-maxtext`` -> DeepSpeed resumes at
  TP=1/2/3 and its step 6 has MaxText's step-6 loss.

Conventions lined up (docs/maxtext.md, "Continue a run in MaxText"): torch's AdamW and optax's adamw with the same
betas, epsilon outside the square root, decoupled weight decay 0.01 on every parameter, a constant rate, clipping
at a global norm of 1. Two differences are MaxText's own and are checked as such: llama-style families (the query
kernel pre-scaled by 1/sqrt(D)) give the query kernel an Adam step sqrt(D) times DeepSpeed's, in HF terms; tied
models (qwen3) compute the logits from the embedding table rounded to bf16, so their gradients are those of that
rounding (checked against transformers and torch's AdamW with the same rounding).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harness.environments import require

require("jax", "the [maxtext] extra")

LR, STEPS = 1e-2, 6  # the demo's DeepSpeed config: AdamW lr 1e-2 (torch's weight decay 0.01), gradient clipping 1

#: (family, scanned, the TP degrees DeepSpeed resumes MaxText's run at). A resume is a torchrun, so one degree per
#: case but llama scanned's. A family per kind of layer (a MaxText training run each, the suite's longest tests): dense with the pre-scaled
#: query, MoE, MLA with its MoE; the layouts alternating, so both layouts and the resume degrees TP=1, 2 and 3 are
#: covered; the conversions themselves are checked on both layouts of every family by tests/unit/test_maxtext.py.
CASES = [("llama", True, (1, 3)), ("mixtral", False, (3, )), ("deepseek-v3", True, (2, ))]
#: The loss bars: fp32 runs to 1e-4 relative; bf16 ones (both compute in bf16, in their own order) to 2e-3.
LOSS_BAR = {"fp32": 1e-4, "bf16": 2e-3}


def _continued_run(scenarios, family: str, dtype: str = "fp32"):
    """DeepSpeed TP=2, saved after steps 3 and 4, trained to step 6 (shared by the family's cases)."""
    return scenarios(f"continue_{family}_{dtype}", convert=False, tp=2, dtype=dtype, family=family, steps=STEPS,
                     save_at=3, save_also=(4, ))


State = dict[str, dict[str, torch.Tensor]]  # HF name -> {"fp32", "exp_avg", "exp_avg_sq"}


def _checkpoint_state(path) -> tuple[State, int]:
    """Every tensor's weights and Adam moments in fp32, and the optimizer step, of any checkpoint we read."""
    from deepspeed_ext.api import open_checkpoint
    state, steps = {}, set()
    for tensor in open_checkpoint(path).tensors():
        state[tensor.name] = {s: tensor.load_tensor(s).float() for s in ("fp32", "exp_avg", "exp_avg_sq")}
        steps.add(int(tensor.load("step")))
    assert len(steps) == 1, steps
    return state, steps.pop()


def _transformers_step(tag_dir, family: str, step: int, tokens: torch.Tensor | None = None,
                       clipping: float = 1.0) -> State:
    """DeepSpeed's step ``step`` as transformers and torch's AdamW take it from the checkpoint ``tag_dir`` (the state
    after ``step - 1``), except that the tied logits use the embedding table rounded to bf16, as MaxText's do
    (``attend_on_embedding`` casts the table to bf16 whatever the run's dtype): what MaxText's step must give.
    ``tokens``: the batch (default DeepSpeed's for that step); ``clipping``: the global-norm bound (0: none)."""
    from deepspeed_ext.demo.models import batch, build_model
    model = build_model(family).float()
    saved, saved_step = _checkpoint_state(tag_dir)
    assert saved_step == step - 1
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=LR)  # DeepSpeed's "Adam" (torch_adam): these defaults
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name]["fp32"])
            optimizer.state[param] = {"step": torch.tensor(float(saved_step)),
                                      "exp_avg": saved[name]["exp_avg"].clone(),
                                      "exp_avg_sq": saved[name]["exp_avg_sq"].clone()}
    tokens = batch(step, 0, 1) if tokens is None else tokens
    hidden = model.model(input_ids=tokens).last_hidden_state
    table = model.get_output_embeddings().weight
    logits = hidden @ table.to(torch.bfloat16).float().T
    vocab = logits.shape[-1]
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
    if clipping:
        torch.nn.utils.clip_grad_norm_(params.values(), clipping)  # DeepSpeed's gradient_clipping
    optimizer.step()
    return {name: {"fp32": param.detach().clone(), "exp_avg": optimizer.state[param]["exp_avg"],
                   "exp_avg_sq": optimizer.state[param]["exp_avg_sq"]} for name, param in params.items()}


def _assert_same_state(expected: State, maxtext_back, family: str, config: dict) -> None:
    """MaxText's state after its step 4 (read through from-maxtext) against what it must be: the parameters within
    fp32 rounding of the two Adam implementations (1e-5, a thousandth of one step of lr 1e-2), the moments within
    1e-3 of their largest value, the optimizer step 4. The pre-scaled query kernel of llama-style families moved by
    sqrt(D) times DeepSpeed's Adam step (MaxText's parameterization): checked as that."""
    from deepspeed_ext.checkpoint.families import get_family
    got_state, got_step = _checkpoint_state(maxtext_back)
    assert got_step == 4 and sorted(got_state) == sorted(expected)
    head_dim = None
    if get_family(family).query_scaled:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for name, want_state in expected.items():
        for state in ("exp_avg", "exp_avg_sq"):
            want, got = want_state[state], got_state[name][state]
            assert (got - want).abs().max() <= 1e-3 * want.abs().max(), (name, state)
        want, got = want_state["fp32"], got_state[name]["fp32"]
        if head_dim is not None and ".q_proj." in name:
            moment, second = want_state["exp_avg"], want_state["exp_avg_sq"]
            adam = (moment / (1 - 0.9**got_step)) / ((second / (1 - 0.999**got_step)).sqrt() + 1e-8)
            extra = -LR * (head_dim**0.5 - 1) * adam  # MaxText's step on the pre-scaled kernel, less DeepSpeed's
            assert (got - want).abs().max() > 0.5 * LR, f"{name}: the query kernel took DeepSpeed's step"
            assert (got - (want + extra)).abs().max() <= 1e-2 * LR * (head_dim**0.5 - 1), name
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family, scan_layers, resume_tps", CASES,
                         ids=[f"{f}-{'scanned' if s else 'unscanned'}" for f, s, _ in CASES])
def test_maxtext_continues_deepspeeds_run_and_deepspeed_continues_maxtexts(scenarios, tmp_path, family, scan_layers,
                                                                           resume_tps):
    _continue_both_ways(scenarios, tmp_path, family, scan_layers, resume_tps, "fp32")


def test_bf16_run_continues_both_ways(scenarios, tmp_path):
    """A bf16 DeepSpeed run (fp32 masters and moments, bf16 compute) and MaxText with dtype=bfloat16 over fp32
    weights: the losses continue within 2e-3 both ways. The states are not compared: each framework computes its
    bf16 gradients in its own order, so they agree only to bf16's precision."""
    _continue_both_ways(scenarios, tmp_path, "llama", True, (2, ), "bf16")


def _printed_settings(printed: str) -> tuple[list[str], list[str]]:
    """The model's and the optimizer's MaxText settings (``KEY=VALUE`` each) that to-maxtext printed."""
    model = printed.split("the model, in MaxText's settings: ", 1)[1].splitlines()[0].split(" ")
    optimizer = printed.split("the optimizer, in MaxText's settings", 1)[1].splitlines()[0].split(": ", 1)[1]
    return model, optimizer.split("; ", 1)[0].split(" ")


def _continue_both_ways(scenarios, tmp_path, family: str, scan_layers: bool, resume_tps: tuple[int, ...],
                        dtype: str) -> None:
    from deepspeed_ext.checkpoint.families import get_family
    from deepspeed_ext.checkpoint.maxtext import adamw_settings, maxtext_settings, settings_text
    from deepspeed_ext.demo.models import batch
    from harness.maxtext import maxtext_train
    from harness.runner import cli
    run = _continued_run(scenarios, family, dtype)
    config = json.loads((run.tag_dir / "deepspeed_ext.json").read_text())["model_config"]
    out = tmp_path / "maxtext"
    printed = cli(["to-maxtext", str(run.tag_dir), "-o", str(out), "--dtype", "float32", "--with-optimizer"]
                  + ([] if scan_layers else ["--no-scan-layers"]), tmp_path / "to_maxtext.log").stdout
    # MaxText runs with the settings to-maxtext printed: the model's, and the optimizer's read from the checkpoint.
    model, optimizer = _printed_settings(printed)
    assert model == settings_text(maxtext_settings(get_family(family), config, scan_layers)).split(" ")
    # The compute dtype too: bf16 activations over fp32 weights and moments, as DeepSpeed's bf16 with fp32 masters.
    compute = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert optimizer == settings_text({**adamw_settings(LR, gradient_clipping=1.0), "dtype": compute}).split(" ")
    settings = model + optimizer + [f"steps={STEPS}", f"load_full_state_path={out / '0' / 'items'}"]
    # The batches DeepSpeed trained steps 4, 5 and 6 on (one DP rank: the whole global batch).
    tokens = np.stack([batch(step, 0, 1).numpy() for step in (4, 5, 6)])
    result = maxtext_train(settings, tokens, tmp_path / "maxtext_run")
    assert result["start_step"] == 3, "MaxText did not restore DeepSpeed's step"
    losses = dict(zip((4, 5, 6), result["losses"]))
    assert losses[4] == pytest.approx(run.baseline[4], rel=LOSS_BAR[dtype])

    (tmp_path / "config.json").write_text(json.dumps(config))
    back = {}
    for index, step in ((0, 4), (1, 5)) if resume_tps else ((0, 4), ):  # MaxText's checkpoints after steps 4, 5
        back[step] = tmp_path / f"from_maxtext_step{step}"
        cli(["from-maxtext", result["checkpoints"][index], "-o", str(back[step]), "--config",
             str(tmp_path / "config.json"), "--quiet"], tmp_path / f"from_maxtext_{step}.log")
        assert (back[step] / "latest_universal").read_text().strip() == f"global_step{step}_universal"
    # The state after the step (fp32 only: bf16 gradients are compared through the losses, see the bf16 test).
    maxtext_state = back[4] / "global_step4_universal"
    if dtype == "fp32" and config.get("tie_word_embeddings"):
        # MaxText's tied logits round the table to bf16: its gradients are transformers' with that rounding (7e-7 of
        # the largest moment measured), 3e-3 off DeepSpeed's exact ones; the loss, near uniform here, moves 1e-7.
        _assert_same_state(_transformers_step(run.tag_dir, family, 4), maxtext_state, family, config)
    elif dtype == "fp32":
        _assert_same_state(_checkpoint_state(run.save_dir / "global_step4")[0], maxtext_state, family, config)

    for tp in resume_tps:
        resumed = run.resume(tp, load_dir=back[5])
        assert sorted(resumed) == [6], f"TP={tp} did not continue at MaxText's step"
        assert resumed[6] == pytest.approx(losses[6], rel=LOSS_BAR[dtype]), f"TP={tp}"


def test_a_warmup_schedule_keeps_its_place_through_maxtext(scenarios, tmp_path):
    """DeepSpeed's WarmupLR (linear over 4 steps) run saved mid-warmup at TP=2 -> to-maxtext --with-optimizer ->
    from-maxtext -> DeepSpeed at TP=1. The round trip is exact: weights, Adam moments and the step, tensor by tensor
    (fp32; head_dim 4 makes the query's 1/2 scaling exact). MaxText's checkpoints carry no scheduler state, so the
    resumed scheduler is put at the step the checkpoint records, and steps 4-6 repeat the uninterrupted run.
    to-maxtext says the rate it prints is the one at the saved step."""
    from harness.runner import cli
    run = scenarios("continue_warmup", tp=2, dtype="fp32", steps=STEPS, save_at=3, warmup_steps=4)
    printed = cli(["to-maxtext", str(run.tag_dir), "-o", str(tmp_path / "maxtext"), "--dtype", "float32",
                   "--with-optimizer"], tmp_path / "to_maxtext.log").stdout
    assert "WarmupLR scheduler: learning_rate is the rate at step 3" in printed
    cli(["from-maxtext", str(tmp_path / "maxtext"), "-o", str(tmp_path / "back"), "--with-optimizer", "--quiet"],
        tmp_path / "from_maxtext.log")
    original, original_step = _checkpoint_state(run.tag_dir)
    returned, returned_step = _checkpoint_state(tmp_path / "back" / "global_step3_universal")
    assert sorted(original) == sorted(returned) and original_step == returned_step == 3
    for name, states in original.items():
        for state, tensor in states.items():
            assert torch.equal(tensor, returned[name][state]), (name, state)
    resumed = run.resume(1, load_dir=tmp_path / "back")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(run.baseline[step], rel=1e-5), step


def test_maxtexts_own_train_main_continues_and_comes_back(scenarios, tmp_path):
    """The docs' commands: MaxText's train.py itself (its whole loop, MaxText's synthetic data) resumes our full state
    at DeepSpeed's step, trains steps 4 and 5, saves with its checkpoint manager; from-maxtext of its last checkpoint
    carries the Adam state and step 5."""
    import subprocess

    from harness.environments import MAXTEXT_PYTHON
    from harness.runner import cli
    run = _continued_run(scenarios, "llama")
    out = tmp_path / "maxtext"
    printed = cli(["to-maxtext", str(run.tag_dir), "-o", str(out), "--dtype", "float32", "--with-optimizer"],
                  tmp_path / "to_maxtext.log").stdout
    model, optimizer = _printed_settings(printed)
    base = subprocess.run([str(MAXTEXT_PYTHON), "-c", "import maxtext, os; print(os.path.join(os.path.dirname("
                           "maxtext.__file__), 'configs', 'base.yml'))"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}, check=True).stdout.split()[-1]
    command = [str(MAXTEXT_PYTHON), "-m", "maxtext.trainers.pre_train.train", base, *model,
               *optimizer, "steps=5", f"load_full_state_path={out / '0' / 'items'}",
               "run_name=continued", f"base_output_directory={tmp_path / 'maxtext_run'}", "dataset_type=synthetic",
               "per_device_batch_size=4", "max_target_length=15", "attention=dot_product",
               "skip_jax_distributed_system=true", "async_checkpointing=false", "checkpoint_period=1",
               "enable_goodput_recording=false", "monitor_goodput=false"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    (tmp_path / "maxtext_train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    checkpoints = tmp_path / "maxtext_run" / "continued" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["3", "4"]
    config = json.loads((run.tag_dir / "deepspeed_ext.json").read_text())["model_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = tmp_path / "back"
    said = cli(["from-maxtext", str(checkpoints), "-o", str(back), "--config", str(tmp_path / "config.json"),
                "--with-optimizer"], tmp_path / "from_maxtext.log").stdout
    assert "Adam state at step 5" in said  # DeepSpeed resuming such a state: the cases above
    assert (back / "latest_universal").read_text().strip() == "global_step5_universal"


def test_another_maxtext_optimizers_state_is_named_not_carried(scenarios, tmp_path):
    """A full state MaxText wrote with opt_type=sgd (its own training from our parameters-only output): inspect names
    it, from-maxtext says on stderr that its optimizer state is not carried and starts DeepSpeed's fresh, and
    from-maxtext --with-optimizer refuses it in one line, writing nothing."""
    from deepspeed_ext.checkpoint.families import get_family
    from deepspeed_ext.checkpoint.maxtext import maxtext_settings, settings_text
    from deepspeed_ext.demo.models import batch
    from harness.maxtext import maxtext_train
    from harness.runner import cli
    run = _continued_run(scenarios, "llama")
    config = json.loads((run.tag_dir / "deepspeed_ext.json").read_text())["model_config"]
    cli(["to-maxtext", str(run.tag_dir), "-o", str(tmp_path / "params"), "--dtype", "float32", "--quiet"],
        tmp_path / "to_maxtext.log")
    settings = (settings_text(maxtext_settings(get_family("llama"), config, True)).split(" ")
                + ["opt_type=sgd", "learning_rate=0.01", "steps=1",
                   f"load_parameters_path={tmp_path / 'params' / '0' / 'items'}"])
    result = maxtext_train(settings, np.stack([batch(1, 0, 1).numpy()]), tmp_path / "sgd_run")
    (tmp_path / "config.json").write_text(json.dumps(config))
    sgd = result["checkpoints"][0]
    said = cli(["inspect", sgd, "--config", str(tmp_path / "config.json")], tmp_path / "inspect.log").stdout
    assert "whose optimizer is not optax adamw" in said
    proc = cli(["from-maxtext", sgd, "-o", str(tmp_path / "refused"), "--config", str(tmp_path / "config.json"),
                "--with-optimizer"], tmp_path / "refused.log", check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert "not optax adamw" in proc.stderr and not (tmp_path / "refused").exists()
    proc = cli(["from-maxtext", sgd, "-o", str(tmp_path / "back"), "--config", str(tmp_path / "config.json")],
               tmp_path / "back.log")
    assert "its optimizer state is not" in proc.stderr and "fresh optimizer state" in proc.stdout


def _maxtext_train_main(settings: list[str], workdir) -> list:
    """MaxText's own train.py (``python -m maxtext.trainers.pre_train.train``), as docs/maxtext.md runs it: MaxText's
    synthetic data (one fixed batch of 4 rows, unpacked), its checkpoint manager saving the full state after every
    step. Returns the checkpoints' directories, in step order."""
    import subprocess

    from harness.environments import MAXTEXT_PYTHON
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    base = subprocess.run([str(MAXTEXT_PYTHON), "-c", "import maxtext, os; print(os.path.join(os.path.dirname("
                           "maxtext.__file__), 'configs', 'base.yml'))"], capture_output=True, text=True, env=env,
                          check=True).stdout.split()[-1]
    command = [str(MAXTEXT_PYTHON), "-m", "maxtext.trainers.pre_train.train", base, *settings, "run_name=continued",
               f"base_output_directory={workdir}", "dataset_type=synthetic", "packing=false",
               "per_device_batch_size=4", "max_target_length=15", "attention=dot_product",
               "skip_jax_distributed_system=true", "async_checkpointing=false", "checkpoint_period=1",
               "enable_goodput_recording=false", "monitor_goodput=false", "matmul_precision=highest"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    (workdir.parent / "maxtext_train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    checkpoints = workdir / "continued" / "checkpoints"
    return [checkpoints / name / "items" for name in sorted((p.name for p in checkpoints.iterdir() if p.name.isdigit()),
                                                               key=int)]


def _maxtext_synthetic_tokens(vocab: int) -> torch.Tensor:
    """The batch MaxText's synthetic data source gives every step at 4 rows of 15 (+1) tokens: its fixed draw, with
    the PRNG train.py sets (``unsafe_rbg``)."""
    import subprocess

    from harness.environments import MAXTEXT_PYTHON
    code = ("import jax, jax.numpy as jnp, json; jax.config.update('jax_default_prng_impl', 'unsafe_rbg'); "
            f"print(json.dumps(jax.random.randint(jax.random.PRNGKey(0), (4, 16), 0, {vocab}, "
            "dtype=jnp.int32).tolist()))")
    out = subprocess.run([str(MAXTEXT_PYTHON), "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}).stdout.split("\n")[-2]
    return torch.tensor(json.loads(out))


@pytest.mark.parametrize("clipping, applied", [("unset", 1.0), ("0", 0.0)], ids=["config-omits-it", "set-to-0"])
def test_maxtext_continues_with_the_clipping_deepspeed_ran(scenarios, tmp_path, clipping, applied):
    """A config that leaves gradient_clipping out runs at DeepSpeed 0.19.8's default, 1.0 (to-maxtext once printed
    0 for it, from the user's dict: MaxText's second step was then 1e-2 off), and one that sets 0 clips nothing.
    to-maxtext prints what the engine ran, with the fp32 compute dtype; MaxText's own train.py, run with those
    settings as docs/maxtext.md runs it (its synthetic batch), takes the step transformers and torch's AdamW take
    from the checkpoint with that clipping, and not the one with the other.

    Compared by the Adam moments, which hold the (clipped) gradient itself: each tensor's within 2% of the distance
    between the two clippings' (measured: 0.4% at most). The weights are not compared: on a batch of uniform random
    tokens many elements have a second moment near zero, where Adam's normalized step turns the two frameworks'
    fp32 rounding of the gradient into steps of ±lr."""
    from deepspeed_ext.checkpoint.maxtext import adamw_settings, settings_text
    from harness.runner import cli
    run = scenarios(f"continue_llama_clip_{clipping}", convert=False, tp=2, dtype="fp32", family="llama", steps=4,
                    save_at=3, gradient_clipping=clipping)
    if clipping == "unset":
        assert "gradient_clipping" not in _saved_config(run)
    out = tmp_path / "maxtext"
    printed = cli(["to-maxtext", str(run.tag_dir), "-o", str(out), "--dtype", "float32", "--with-optimizer"],
                  tmp_path / "to_maxtext.log").stdout
    model, optimizer = _printed_settings(printed)
    assert optimizer == settings_text({**adamw_settings(LR, gradient_clipping=applied), "dtype": "float32"}).split(" ")
    checkpoints = _maxtext_train_main(model + optimizer + ["steps=4", f"load_full_state_path={out / '0' / 'items'}"],
                                      tmp_path / "maxtext_run")
    config = json.loads((run.tag_dir / "deepspeed_ext.json").read_text())["model_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    cli(["from-maxtext", str(checkpoints[-1]), "-o", str(tmp_path / "back"), "--config", str(tmp_path / "config.json"),
         "--with-optimizer", "--quiet"], tmp_path / "from_maxtext.log")
    got, step = _checkpoint_state(tmp_path / "back")
    assert step == 4
    tokens = _maxtext_synthetic_tokens(config["vocab_size"])
    expected = _transformers_step(run.tag_dir, "llama", 4, tokens, clipping=applied)
    other = _transformers_step(run.tag_dir, "llama", 4, tokens, clipping=1.0 - applied)
    for name in expected:
        for state in ("exp_avg", "exp_avg_sq"):
            off = (got[name][state] - expected[name][state]).norm()
            apart = (other[name][state] - expected[name][state]).norm()
            assert apart > 0 and off <= 0.02 * apart, (name, state, float(off), float(apart))


def _saved_config(run) -> dict:
    from deepspeed_ext.checkpoint import serialization
    return serialization.load(run.tag_dir / "mp_rank_00_model_states.pt")["ds_config"]
