"""The CLI on a real DeepSpeed checkpoint (TP=2, ZeRO-1, bf16): upstream ds_to_universal's spelling, the MaxText
full-state summary, and to-hf's generation config."""

from __future__ import annotations

import json
import shutil

from harness.runner import cli


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_to_universal_takes_ds_to_universal_options(scenarios, tmp_path):
    """--input_folder TAG --output_folder DIR (plus upstream's tuning flags) writes DIR as the universal
    directory itself and latest_universal beside it, as upstream does; the files are those of our own spelling."""
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    save = tmp_path / "ckpt"
    shutil.copytree(tp2.save_dir, save, ignore=shutil.ignore_patterns("*_universal", "latest_universal"))
    out = save / "global_step3_universal"
    cli(["to-universal", "--input_folder", str(save / "global_step3"), "--output_folder", str(out),
         "--num_extract_workers", "4", "--num_merge_workers", "2", "--no_strict", "-q"], tmp_path / "upstream.log")
    assert (save / "latest_universal").read_text().strip() == "global_step3_universal"
    assert _files(out) == _files(tp2.universal_dir)
    proc = cli(["to-universal", str(save), "--input_folder", str(save / "global_step1")], tmp_path / "twice.log",
               check=False)
    assert proc.returncode == 2 and "give the checkpoint once" in proc.stderr


def test_to_maxtext_with_optimizer_names_the_full_state_load(scenarios, tmp_path):
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    proc = cli(["to-maxtext", str(tp2.save_dir), "-o", str(tmp_path / "maxtext"), "--with-optimizer"],
               tmp_path / "to.log")
    items = tmp_path / "maxtext" / "0" / "items"
    assert f"load_full_state_path={items}" in proc.stdout and f"load_parameters_path={items}" in proc.stdout
    assert "to-maxtext:" in proc.stderr  # the progress bar's label


def test_to_hf_from_deepspeed_writes_the_generation_config_save_pretrained_would(scenarios, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    cli(["to-hf", str(tp2.save_dir), "-o", str(tmp_path / "hf"), "-q"], tmp_path / "to_hf.log")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reference = tmp_path / "save_pretrained"
    model.save_pretrained(reference)
    ours = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    theirs = json.loads((reference / "generation_config.json").read_text())
    assert ours == theirs
    assert GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == model.config.eos_token_id


def test_at_a_terminal_a_command_says_what_it_does_before_the_imports(scenarios, tmp_path):
    """Importing torch and DeepSpeed takes seconds before the first tensor is read: at a terminal the first thing
    on stderr says so (piped, stderr stays quiet, so an error is still exactly one line)."""
    import os
    import pty
    import subprocess
    import sys

    from harness.runner import child_env
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "deepspeed_ext", "to-universal", str(tp2.save_dir), "-o",
                             str(tmp_path / "universal")], stdout=subprocess.PIPE, stderr=terminal, env=child_env())
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        seen += chunk
    proc.communicate(timeout=300)
    os.close(controller)
    assert proc.returncode == 0, seen.decode(errors="replace")
    first = seen.decode(errors="replace").lstrip().splitlines()[0]
    assert first.startswith("deepspeed-ext to-universal: loading libraries"), first
