"""Bad inputs to the bridges: every fault is one line naming the file and the problem, exit 2, no output.

The DeepSpeed-side faults (truncated, missing or mixed files, disagreeing degrees, a full disk, a planted
pickle) are in tests/e2e/test_end_to_end.py, which has a real engine's checkpoint to damage; a full disk while
the bridges write (a subprocess under RLIMIT_FSIZE) is in tests/e2e/test_reliability_e2e.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.cli import cli_result, make_sources, universal_in


def _run(*args: str) -> subprocess.CompletedProcess:
    return cli_result(*args, "-q")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A sharded HF checkpoint of the tiny Llama and its MaxText conversion."""
    return make_sources(tmp_path_factory.mktemp("sources"))


def _damage_safetensors_truncate(directory: Path) -> Path:
    target = sorted(directory.glob("*.safetensors"))[1]
    target.write_bytes(target.read_bytes()[:1000])
    return target


def _damage_safetensors_header(directory: Path) -> Path:
    target = sorted(directory.glob("*.safetensors"))[1]
    data = bytearray(target.read_bytes())
    data[10:20] = b"\xff" * 10
    target.write_bytes(bytes(data))
    return target


def _damage_orbax_data(root: Path) -> Path:
    items = root / "0" / "items"
    largest = max((p for p in items.rglob("*") if p.is_file() and "ocdbt.process" in str(p)),
                  key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:largest.stat().st_size // 2])
    return items


def _damage_orbax_metadata(root: Path) -> Path:
    metadata = root / "0" / "items" / "_METADATA"
    metadata.write_text("{not json")
    return metadata


FAULTS = {
    "truncated safetensors": ("hf", _damage_safetensors_truncate, "from-hf", "cannot read safetensors"),
    "corrupt safetensors header": ("hf", _damage_safetensors_header, "to-hf", "cannot read safetensors"),
    "truncated Orbax data file": ("maxtext", _damage_orbax_data, "from-maxtext", "cannot read array"),
    "corrupt Orbax _METADATA": ("maxtext", _damage_orbax_metadata, "from-maxtext", "cannot read the Orbax metadata"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_corrupt_bridge_inputs_get_one_line(sources, tmp_path, fault):
    kind, damage, command, message = FAULTS[fault]
    source = tmp_path / kind
    shutil.copytree(sources / kind, source)
    named = damage(source)
    argument = source / "0" / "items" if command == "from-maxtext" else source
    out = tmp_path / "out"
    proc = _run(command, str(argument), "-o", str(out))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"deepspeed-ext: error: {named}") and message in lines[0], lines
    assert not out.exists() and not out.with_name("out.partial").exists()


def _flip_to_nan(shard: Path) -> None:
    """Overwrite the first element of the first tensor of a safetensors file with an fp32 NaN."""
    data = bytearray(shard.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header:12 + header] = bytes.fromhex("0000c07f")
    shard.write_bytes(bytes(data))


def test_verify_accepts_fresh_outputs_and_names_each_damage(sources, tmp_path):
    """Every converter writes a manifest; `verify` passes a fresh HF, universal and MaxText output and, after
    damage, names each file that changed, appeared or broke, and each tensor with NaN/Inf (exit 1)."""
    hf, saved = tmp_path / "hf", tmp_path / "universal"
    assert _run("to-hf", str(sources / "hf"), "-o", str(hf)).returncode == 0
    assert _run("from-hf", str(sources / "hf"), "-o", str(saved)).returncode == 0
    universal = universal_in(saved)
    for out in (hf, saved, universal, sources / "maxtext", sources / "maxtext" / "0" / "items"):
        proc = cli_result("verify", str(out))
        assert proc.returncode == 0 and ": OK: " in proc.stdout and " 0 problem(s)" in proc.stdout, proc.stdout

    shard = sorted(hf.glob("*.safetensors"))[0]
    _flip_to_nan(shard)
    broken = universal / "zero" / "model.norm.weight" / "fp32.pt"
    broken.write_bytes(broken.read_bytes()[:100])
    (universal / "notes.txt").write_text("not ours")
    proc = cli_result("verify", str(hf))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{shard}: contents differ from the manifest (crc32c mismatch)" in proc.stdout
    assert "has NaN/Inf" in proc.stdout and ": FAILED: " in proc.stdout
    proc = cli_result("verify", str(universal))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{broken}: 100 bytes, the manifest says" in proc.stdout
    assert f"{broken}: cannot read torch file" in proc.stdout
    assert f"{universal / 'notes.txt'}: not covered by the manifest" in proc.stdout


def test_verify_reports_files_added_beside_an_output_and_fails_on_them_only_with_strict(sources, tmp_path):
    """A README and a tokenizer added to an intact HF output: reported as not covered by the manifest, exit 0;
    --strict makes them problems (exit 1). A missing manifest-listed file stays an error either way."""
    hf = tmp_path / "hf"
    assert cli_result("to-hf", str(sources / "hf"), "-o", str(hf), "-q").returncode == 0
    (hf / "README.md").write_text("my model")
    (hf / "extra").mkdir()
    (hf / "extra" / "tokenizer.json").write_text("{}")
    proc = cli_result("verify", str(hf))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{hf / 'README.md'}: not covered by the manifest" in proc.stdout
    assert f"{hf / 'extra' / 'tokenizer.json'}: not covered by the manifest" in proc.stdout
    assert ": OK: " in proc.stdout and "0 problem(s), 2 file(s) not covered by the manifest" in proc.stdout
    proc = cli_result("verify", str(hf), "--strict")
    assert proc.returncode == 1 and f"{hf / 'README.md'}: not in the manifest" in proc.stdout
    assert ": FAILED: " in proc.stdout and "2 problem(s)" in proc.stdout
    (hf / "config.json").unlink()  # listed in the manifest: missing is an error, strict or not
    proc = cli_result("verify", str(hf), "--config", str(sources / "hf" / "config.json"))
    assert proc.returncode == 1 and f"{hf / 'config.json'}: missing" in proc.stdout, proc.stdout


@pytest.mark.parametrize("command", ["to-maxtext", "from-maxtext", "to-hf"])
def test_shapes_that_do_not_fit_the_model_config_are_refused(sources, tmp_path, command):
    """A --config whose intermediate size differs from the checkpoint's tensors: one line naming the first
    parameter that does not fit, exit 2, no output."""
    import json
    config = json.loads((sources / "hf" / "config.json").read_text())
    (tmp_path / "wrong.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    source = sources / "maxtext" / "0" / "items" if command == "from-maxtext" else sources / "hf"
    out = tmp_path / "out"
    proc = _run(command, str(source), "-o", str(out), "--config", str(tmp_path / "wrong.json"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (f"deepspeed-ext: error: {source}: parameters do not fit LlamaConfig's model "
                        "(model.layers.0.mlp.down_proj.weight is [64, 160], the config says [64, 96]); wrong --config?")
    assert not out.exists()


def test_a_family_that_does_not_fit_is_refused(sources, tmp_path):
    proc = _run("to-maxtext", str(sources / "hf"), "-o", str(tmp_path / "out"), "--family", "qwen3")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "family 'qwen3' expects 'model.layers.0.self_attn.q_norm.weight'" in lines[0]
    assert "wrong --family?" in lines[0]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- fingerprints carried by the outputs
def test_every_output_records_the_fingerprints_of_what_it_holds(sources, tmp_path):
    """from-hf → universal → to-hf → to-maxtext → from-maxtext: each output's metadata holds a fingerprint per
    tensor equal to the tensor it holds (MaxText's: the tensor before its layout transforms, read back within
    the stored precision's rounding), and each conversion checked its source's record on the way."""
    import json

    import torch
    from safetensors import safe_open

    from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    from deepspeed_ext.checkpoint.hf import METADATA_FINGERPRINTS

    assert _run("from-hf", str(sources / "hf"), "-o", str(tmp_path / "uni")).returncode == 0
    universal = universal_in(tmp_path / "uni")
    recorded = Fingerprints.from_json(json.loads((universal / "deepspeed_ext.json").read_text())["fingerprints"])
    names = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    assert sorted(recorded.tensors) == names
    for name in names:
        held = torch.load(universal / "zero" / name / "fp32.pt", weights_only=True)["param"]
        assert recorded.get(name, "fp32") == Fingerprint.of(held), name

    assert _run("to-hf", str(universal), "-o", str(tmp_path / "hf"), "--max-shard-size", "30KB").returncode == 0
    found = Fingerprints()
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.merge(Fingerprints.from_json(json.loads(handle.metadata()[METADATA_FINGERPRINTS])))
            for name in handle.keys():
                if name in found.tensors:
                    assert found.get(name, "fp32") == Fingerprint.of(handle.get_tensor(name)), name
    assert sorted(found.tensors) == names
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # the metadata is invisible to transformers

    assert _run("to-maxtext", str(tmp_path / "hf"), "-o", str(tmp_path / "mt")).returncode == 0
    recorded_mt = json.loads((tmp_path / "mt" / "0" / "_CHECKPOINT_METADATA").read_text())
    mt_fingerprints = Fingerprints.from_json(recorded_mt["custom_metadata"]["deepspeed_ext"]["fingerprints"])
    assert sorted(mt_fingerprints.tensors) == names and mt_fingerprints.rounding == 0.0  # what a read returns
    read_mt = open_checkpoint(tmp_path / "mt")
    assert read_mt.info.fingerprints is not None
    for tensor in read_mt.tensors():  # the record is exact: the arrays undone from MaxText's layout in fp32
        found = Fingerprint.of(tensor.load("fp32"))
        assert read_mt.info.fingerprints.get(tensor.name, "fp32").agrees(found), tensor.name
    assert _run("from-maxtext", str(tmp_path / "mt"), "-o", str(tmp_path / "back")).returncode == 0


def test_a_source_that_disagrees_with_its_record_is_refused(sources, tmp_path):
    """A weight changed after it was written (HF), a record that no longer fits the arrays (MaxText): every
    conversion from it (to universal, HF and MaxText) names the tensor and both values, exit 2, nothing written."""
    import json
    import struct

    assert _run("from-hf", str(sources / "hf"), "-o", str(tmp_path / "uni")).returncode == 0
    assert _run("to-hf", str(universal_in(tmp_path / "uni")), "-o", str(tmp_path / "hf")).returncode == 0
    target = tmp_path / "hf" / "model.safetensors"
    data = bytearray(target.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    start, _ = header["model.norm.weight"]["data_offsets"]
    data[8 + size + start:8 + size + start + 8] = bytes(8)
    target.write_bytes(bytes(data))
    for command in ("from-hf", "to-hf", "to-maxtext"):
        proc = _run(command, str(tmp_path / "hf"), "-o", str(tmp_path / "out"))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (command, proc.stderr)
        assert "recorded fingerprints disagree" in lines[0] and "'model.norm.weight' fp32: recorded" in lines[0]
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists(), command

    shutil.copytree(sources / "maxtext", tmp_path / "mt")
    metadata = tmp_path / "mt" / "0" / "_CHECKPOINT_METADATA"
    content = json.loads(metadata.read_text())
    recorded = content["custom_metadata"]["deepspeed_ext"]["fingerprints"]["tensors"]
    fingerprint = recorded["model.layers.1.mlp.up_proj.weight"]["fp32"]
    fingerprint[2] *= 1 + 1e-4  # the sum of squares off by far less than one bf16 rounding: still found
    metadata.write_text(json.dumps(content))
    for command in ("from-maxtext", "to-hf"):
        proc = _run(command, str(tmp_path / "mt"), "-o", str(tmp_path / "out"))
        assert proc.returncode == 2 and "'model.layers.1.mlp.up_proj.weight' fp32: recorded" in proc.stderr, command
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists(), command


@pytest.mark.parametrize("damage", ["flipped byte", "truncated array file", "stray file"])
def test_verify_names_damage_to_a_maxtext_output(sources, tmp_path, damage):
    """A flipped byte or a truncated OCDBT data file is named against the manifest (exit 1); a stray file is
    reported as not covered by it (exit 0; --strict: exit 1)."""
    root = tmp_path / "maxtext"
    shutil.copytree(sources / "maxtext", root)
    data = sorted((root / "0" / "items").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)[-1]
    if damage == "flipped byte":
        content = bytearray(data.read_bytes())
        content[len(content) // 2] ^= 0x10
        data.write_bytes(bytes(content))
    elif damage == "truncated array file":
        data.write_bytes(data.read_bytes()[:data.stat().st_size // 3])
    else:
        (root / "0" / "items" / "stray.bin").write_bytes(b"x")
    for path in (root, root / "0" / "items"):
        proc = cli_result("verify", str(path))
        if damage == "stray file":
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert f"{root / '0' / 'items' / 'stray.bin'}: not covered by the manifest" in proc.stdout
            assert cli_result("verify", str(path), "--strict").returncode == 1
        else:
            assert proc.returncode == 1, proc.stdout + proc.stderr
            said = "contents differ from the manifest" if damage == "flipped byte" else "bytes, the manifest says"
            named = [line for line in proc.stdout.splitlines() if line.startswith(f"{data}: ")]
            assert named and said in named[0], proc.stdout


def test_a_universal_checkpoint_missing_a_parameter_or_a_moment_fails_without_its_manifest(tmp_path):
    """A conversion killed midway (or a directory deleted by hand) leaves no manifest to check against: the
    reader itself refuses what the checkpoint's own records say is missing, and verify reports it."""
    import shutil

    from harness.cli import make_formats

    from deepspeed_ext import verify
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    from deepspeed_ext.errors import CheckpointError
    universal = make_formats(tmp_path)["universal"]
    tag = next(p for p in universal.iterdir() if (p / "zero").is_dir())
    (tag / "deepspeed_ext.manifest.json").unlink(missing_ok=True)
    (universal / "deepspeed_ext.manifest.json").unlink(missing_ok=True)
    params = sorted(p for p in (tag / "zero").iterdir() if p.is_dir())
    for param in params:  # moments, as a checkpoint with optimizer state has them
        for state in ("exp_avg", "exp_avg_sq"):
            shutil.copyfile(param / "fp32.pt", param / f"{state}.pt")
    assert verify(universal).ok

    (params[-1] / "exp_avg.pt").unlink()
    report = verify(universal)
    assert not report.ok and any(f"{params[-1] / 'exp_avg.pt'}: missing" in line for line in report.problems), \
        report.problems

    shutil.rmtree(params[1])
    with pytest.raises(CheckpointError, match=f"{params[1].name}: missing .*deepspeed_ext.json lists 1 parameter"):
        open_checkpoint(universal)
    report = verify(universal)
    assert not report.ok and not report.opened and "deepspeed_ext.json lists 1 parameter" in report.problems[0]
