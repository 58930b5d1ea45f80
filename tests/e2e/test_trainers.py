"""The Hugging Face Trainer and Accelerate, with deepspeed-ext enabled from the DeepSpeed config
(``deepspeed_ext.enable()`` plus the config section), on the real Trainer, Accelerate and DeepSpeed engine.

One process per TP rank (DP=1), so the global batch (4 sequences) is the same at every TP degree and a resumed
run sees the batches the uninterrupted one saw: its losses must match within 2e-3 relative.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from harness.runner import cli, run_logged

WORKERS = Path(__file__).resolve().parents[1] / "harness" / "workers"
REL_TOL = 2e-3


def torchrun(worker: str, nproc: int, args: list[str], log: Path, check: bool = True):
    return run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                       str(WORKERS / worker), *args], log, check=check)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_losses_continue(resumed: dict, baseline: dict, first: int = 4, last: int = 6) -> None:
    """The resumed run starts after the saved step and its losses are the uninterrupted run's."""
    steps = sorted(int(step) for step in resumed["losses"])
    assert steps == list(range(first, last + 1)), steps  # the Trainer's global step carried on
    for step in steps:
        got, want = resumed["losses"][str(step)], baseline["losses"][str(step)]
        assert abs(got - want) <= REL_TOL * abs(want), (step, got, want)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """``trainer_runs(zero)``: an uninterrupted TP=2 Trainer run of 6 steps that saved checkpoint-3 and -6."""
    cache: dict[int, tuple[Path, dict]] = {}

    def get(zero: int) -> tuple[Path, dict]:
        if zero not in cache:
            root = tmp_path_factory.mktemp(f"trainer_zero{zero}")
            torchrun("hf_trainer.py", 2, ["--tp", "2", "--zero", str(zero), "--steps", "6", "--save-steps", "3",
                                          "--output-dir", str(root / "out"), "--result", str(root / "base.json")],
                     root / "base.log")
            cache[zero] = root / "out", read(root / "base.json")
        return cache[zero]

    return get


#: Each ZeRO stage at one degree, each degree at one stage (a Trainer run is a torchrun of its own, 20-30 s here).
@pytest.mark.parametrize("zero, tp", [(1, 4), (3, 1)])
def test_trainer_resumes_from_checkpoint_n_at_another_tp(trainer_runs, zero, tp, tmp_path):
    """resume_from_checkpoint=OUT/checkpoint-3 at TP=1 / TP=4, straight from the TP=2 save (load-time
    resharding): step, LR schedule and losses carry on."""
    out, baseline = trainer_runs(zero)
    torchrun("hf_trainer.py", tp, ["--tp", str(tp), "--zero", str(zero), "--steps", "6", "--save-steps", "100",
                                   "--output-dir", str(tmp_path / "resumed"), "--resume", str(out / "checkpoint-3"),
                                   "--result", str(tmp_path / "resumed.json")], tmp_path / "resumed.log")
    resumed = read(tmp_path / "resumed.json")
    assert resumed["global_step"] == 6
    assert_losses_continue(resumed, baseline)
    # The Trainer's own load_checkpoint call went through the resume-fingerprint check.
    assert (tmp_path / "resumed.log").read_text().count("resume fingerprints match") == 1
    for step in ("4", "5", "6"):  # the LR schedule continues where it was (warmup 2, linear decay over 6)
        assert resumed["learning_rates"][step] == pytest.approx(baseline["learning_rates"][step])


@pytest.mark.parametrize("zero", [3])  # ZeRO-1's universal form: the Accelerate and the documented-script tests
def test_trainer_resumes_through_to_universal(trainer_runs, zero, tmp_path):
    """to-universal on the Trainer's checkpoint-3, then resume at TP=1 with checkpoint.load_universal."""
    out, baseline = trainer_runs(zero)
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(out / "checkpoint-3", checkpoint)
    cli(["to-universal", str(checkpoint), "-q"], tmp_path / "convert.log")
    assert (checkpoint / "latest_universal").read_text().strip() == "global_step3_universal"
    torchrun("hf_trainer.py", 1, ["--tp", "1", "--zero", str(zero), "--steps", "6", "--save-steps", "100",
                                  "--output-dir", str(tmp_path / "resumed"), "--resume", str(checkpoint),
                                  "--load-universal", "--result", str(tmp_path / "resumed.json")],
             tmp_path / "resumed.log")
    assert_losses_continue(read(tmp_path / "resumed.json"), baseline)
    assert (tmp_path / "resumed.log").read_text().count("resume fingerprints match") == 1


def test_commands_take_the_trainer_output_dir_and_pick_the_newest_checkpoint(trainer_runs, tmp_path):
    """inspect / verify / to-universal / to-hf accept OUT (as resume_from_checkpoint=True: the highest
    checkpoint-N) and a checkpoint-N; to-hf writes what save_pretrained would, tokenizer included."""
    out, _ = trainer_runs(1)
    trainer_out = tmp_path / "out"
    shutil.copytree(out, trainer_out)
    inspected = cli(["inspect", str(trainer_out), "--json"], tmp_path / "inspect.log")
    summary = json.loads(inspected.stdout)
    assert summary["tag"] == "global_step6" and summary["global_steps"] == 6
    assert "checkpoint-6" in inspected.stderr  # says which checkpoint it read
    assert json.loads(cli(["inspect", str(trainer_out / "checkpoint-3"), "--json"],
                          tmp_path / "inspect3.log").stdout)["tag"] == "global_step3"
    verified = cli(["verify", str(trainer_out)], tmp_path / "verify.log")
    assert "global_step6: OK" in verified.stdout

    cli(["to-universal", str(trainer_out), "-o", str(tmp_path / "universal"), "-q"], tmp_path / "universal.log")
    assert (tmp_path / "universal" / "latest_universal").read_text().strip() == "global_step6_universal"

    hf_dir = tmp_path / "hf"
    cli(["to-hf", str(trainer_out), "-o", str(hf_dir), "-q"], tmp_path / "to_hf.log")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        assert (hf_dir / name).is_file(), name
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer("t5 t7").input_ids == [5, 7]
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    source = DeepSpeedCheckpoint(trainer_out / "checkpoint-6")
    for name, param in model.named_parameters():  # to-hf keeps the checkpoint's bf16
        assert torch.equal(param.data, source.full_tensor(name).to(torch.bfloat16)), name


@pytest.mark.parametrize("point", ["mid-file", "before-marker"])
def test_a_trainer_save_killed_mid_way_is_skipped_and_the_run_resumes_from_the_one_before(trainer_runs, tmp_path,
                                                                                          monkeypatch, point):
    """Every rank SIGKILLed while the Trainer saves checkpoint-6 (inside a file, or with every file written but
    before its DeepSpeed save is committed): the commands on the output_dir read checkpoint-3 and name
    checkpoint-6 as unfinished, checkpoint-6 itself is refused in one line, and resume_from_checkpoint=True resumes
    from checkpoint-3 at TP=1 (transformers alone would take checkpoint-6)."""
    _, baseline = trainer_runs(1)
    out = tmp_path / "out"
    monkeypatch.setenv("DEEPSPEED_EXT_FAULT", f"{point}@global_step6")
    proc = torchrun("hf_trainer.py", 2, ["--tp", "2", "--steps", "6", "--save-steps", "3", "--output-dir", str(out),
                                         "--result", str(tmp_path / "killed.json")], tmp_path / "killed.log",
                    check=False)
    monkeypatch.delenv("DEEPSPEED_EXT_FAULT")
    assert proc.returncode != 0 and "SIGKILL" in proc.stdout + proc.stderr
    torn = out / "checkpoint-6"
    assert torn.is_dir() and not (torn / "latest").exists() and not (torn / "trainer_state.json").exists()
    assert (out / "checkpoint-3" / "latest").read_text() == "global_step3"
    inspected = cli(["inspect", str(out), "--json"], tmp_path / "inspect.log")
    assert json.loads(inspected.stdout)["tag"] == "global_step3"
    assert f"skipping {torn}" in inspected.stderr and "did not finish" in inspected.stderr, inspected.stderr
    for args in (["verify", str(torn)], ["inspect", str(torn)],
                 ["to-universal", str(torn), "-o", str(tmp_path / "uni"), "-q"]):
        refused = cli(args, tmp_path / f"{args[0]}-torn.log", check=False)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("deepspeed-ext: error:")]
        assert refused.returncode != 0 and len(errors) == 1, (args, refused.stderr)
        assert "did not finish" in errors[0] and str(out / "checkpoint-3") in errors[0], errors
    assert not (tmp_path / "uni").exists()
    torchrun("hf_trainer.py", 1, ["--tp", "1", "--steps", "6", "--save-steps", "100", "--output-dir", str(out),
                                  "--resume", "latest", "--result", str(tmp_path / "resumed.json")],
             tmp_path / "resumed.log")
    assert f"not resuming from {torn}" in (tmp_path / "resumed.log").read_text()
    assert_losses_continue(read(tmp_path / "resumed.json"), baseline)


@pytest.mark.parametrize("snapshot", ["fork", "copy"])
def test_trainer_rotation_never_deletes_the_last_committed_checkpoint_while_a_save_is_written(trainer_runs, tmp_path,
                                                                                             monkeypatch, snapshot):
    """``async_save`` (either snapshot) with the Trainer saving every step and ``save_total_limit=1``, each
    background write slowed down: when each save returns (after the Trainer's rotation, which runs right then) the
    newest committed checkpoint is still there; at the end only checkpoint-6 is left, complete; the losses are the
    synchronous run's."""
    _, baseline = trainer_runs(1)
    out = tmp_path / "out"
    monkeypatch.setenv("DEEPSPEED_EXT_FAULT", "files-written=sleep0.5")
    torchrun("hf_trainer.py", 2, ["--tp", "2", "--steps", "6", "--save-steps", "1", "--save-total-limit", "1",
                                  "--async-save", snapshot, "--output-dir", str(out), "--result",
                                  str(tmp_path / "run.json")],
             tmp_path / "run.log")
    run = read(tmp_path / "run.json")
    saves = {int(step): seen for step, seen in run["after_saves"].items()}
    assert sorted(saves) == [1, 2, 3, 4, 5, 6]
    for step in range(2, 7):  # the Trainer saves each checkpoint-N twice (save_model, then the optimizer's)
        assert f"checkpoint-{step - 1}" in saves[step]["complete"], (step, saves[step])
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-6"]
    assert (out / "checkpoint-6" / "latest").read_text() == "global_step6"
    for step in range(1, 7):
        got, want = run["losses"][str(step)], baseline["losses"][str(step)]
        assert abs(got - want) <= REL_TOL * abs(want), (step, got, want)


def test_resume_at_another_tp_without_the_extension_fails_upstream_and_inspect_says_what_to_do(trainer_runs,
                                                                                               tmp_path):
    """Without the deepspeed_ext section DeepSpeed is on its own: its loader fails at another TP degree. Our
    side (inspect) names the fix."""
    out, _ = trainer_runs(1)
    proc = torchrun("hf_trainer.py", 1, ["--tp", "1", "--steps", "6", "--save-steps", "100", "--no-ext",
                                         "--output-dir", str(tmp_path / "resumed"), "--resume",
                                         str(out / "checkpoint-3"), "--result", str(tmp_path / "r.json")],
                    tmp_path / "resumed.log", check=False)
    assert proc.returncode != 0 and not (tmp_path / "r.json").exists()
    summary = json.loads(cli(["inspect", str(out / "checkpoint-3"), "--json"], tmp_path / "inspect.log").stdout)
    assert "deepspeed_ext.enable()" in summary["resume"] and "to-universal" in summary["resume"]


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    # Saved in the background ("async_save"): the loop trains on while save_state's files are written.
    torchrun("accelerate_loop.py", 2, ["--tp", "2", "--steps", "6", "--save-at", "3", "--save-dir",
                                       str(root / "state"), "--async-save", "--result", str(root / "base.json")],
             root / "base.log")
    return root / "state", read(root / "base.json")


@pytest.mark.parametrize("tp", [4])  # TP=1: the documented Accelerate script's resume (below)
def test_accelerate_load_state_at_another_tp(accelerate_run, tp, tmp_path):
    """accelerator.save_state at TP=2, accelerator.load_state at TP=4: the losses continue."""
    state, baseline = accelerate_run
    assert (state / "pytorch_model" / "deepspeed_ext.json").is_file()  # the tags were saved
    torchrun("accelerate_loop.py", tp, ["--tp", str(tp), "--steps", "6", "--load-dir", str(state), "--result",
                                        str(tmp_path / "resumed.json")], tmp_path / "resumed.log")
    assert_losses_continue(read(tmp_path / "resumed.json"), baseline)


def _documented_script(name: str) -> str:
    """The script ``name`` as docs/trainers.md shows it (the code block that starts with ``# name``)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "trainers.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    (script, ) = [block for block in blocks if block.startswith(f"# {name}")]
    return script


@pytest.mark.parametrize("name, resume_arg", [("train_trainer.py", "out-tp2/checkpoint-3"),
                                              ("train_accelerate.py", "state")])
def test_the_documented_scripts_save_at_tp2_and_resume_at_tp1(name, resume_arg, tmp_path):
    script = tmp_path / name
    script.write_text(_documented_script(name))

    def run(tp: int, *extra: str) -> str:
        proc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
                           str(script), str(tp), *extra], tmp_path / f"tp{tp}.log", cwd=tmp_path)
        return proc.stdout + proc.stderr

    run(2)
    resumed = run(1, resume_arg)
    if name == "train_trainer.py":
        assert json.loads((tmp_path / "out-tp1" / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] \
            == 6
        assert (tmp_path / "out-tp2" / "checkpoint-3" / "global_step3" / "deepspeed_ext.commit.json").is_file()
    else:
        assert "step 4 loss" in resumed and "step 1 loss" not in resumed
