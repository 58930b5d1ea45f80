"""``verify``: check a checkpoint in any format and report every problem found, not just the first.

* An output of deepspeed-ext: every file against its manifest (size and CRC-32C; missing, extra, changed).
* A DeepSpeed checkpoint (it has no manifest): saved by deepspeed-ext, every file against its commit marker (size,
  CRC-32); otherwise every zip record against its CRC-32 (a file cut short or with holes is found); and every
  ``.pt`` file loads with the safe loader.
* Every format: every tensor state is read; its shape must match the checkpoint's metadata, it must be floating
  point and finite; merging checks that TP shards fit their layouts and that replicas agree. A Hugging Face
  checkpoint's parameters must fit transformers' model for its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deepspeed_ext.checkpoint.formats import FORMATS, Format, checkpoint_path, detect, open_checkpoint
from deepspeed_ext.errors import CheckpointError, DamagedFilesError, MissingConfigError


@dataclass
class VerifyReport:
    """What :func:`verify` found: ``ok`` when ``problems`` is empty."""

    #: The directory reported on (a MaxText output's root, where its manifest is).
    root: Path
    #: What was checked file by file, in words.
    files_checked: str
    #: How many tensor states were read and checked.
    tensors: int = 0
    problems: list[str] = field(default_factory=list)
    #: Files beside a manifest that it does not list (added after the output was written, or left by
    #: something else): reported, and problems only when ``strict``.
    unlisted: list[Path] = field(default_factory=list)
    strict: bool = False
    #: False when the checkpoint did not even open (then ``problems`` says why).
    opened: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems and not (self.strict and self.unlisted)

    def lines(self) -> list[str]:
        """Each problem and each file the manifest does not cover, then one summary line."""
        if not self.opened:
            return [*self.problems, f"{self.root}: FAILED: the checkpoint does not open, 1 problem(s)"]
        if self.strict:
            notes = [f"{file}: not in the manifest" for file in self.unlisted]
            problems = len(self.problems) + len(notes)
            extra = ""
        else:
            notes = [f"{file}: not covered by the manifest (not checked; --strict makes this an error)"
                     for file in self.unlisted]
            problems = len(self.problems)
            extra = f", {len(notes)} file(s) not covered by the manifest" if notes else ""
        return [*self.problems, *notes, f"{self.root}: {'OK' if self.ok else 'FAILED'}: {self.files_checked}, "
                f"{self.tensors} tensors (shape, dtype, finite), {problems} problem(s){extra}"]


def verify(path: str | Path, *, config: str | Path | None = None, family: str | None = None,
           strict: bool = False) -> VerifyReport:
    """Verify the checkpoint at ``path``. Raises :class:`CheckpointError` when ``path`` is no checkpoint at all,
    and :class:`MissingConfigError` when a model config is needed and there is none (nothing to verify
    against); a damaged checkpoint is a report with problems, not an exception. ``strict``: files beside a
    manifest that it does not list are problems too (by default they are reported only)."""
    from deepspeed_ext.checkpoint.tensor import FiniteCheck
    fmt = FORMATS[detect(path)]  # not a checkpoint at all: an error, not a failed verification
    path = checkpoint_path(path)  # a Trainer output_dir: its newest checkpoint-N
    try:
        source = open_checkpoint(path, config=config, family=family, mtp="drop")  # an MTP layer is not checked
    except CheckpointError as exc:
        # What does not open may not open because a file is damaged: where the format's files are checked by our
        # manifest (which needs no reader), that check names the file, and comes first.
        damaged = _manifest_problems(fmt, Path(path))
        if damaged:
            return VerifyReport(Path(path), "", problems=[*damaged, f"{exc} (it does not open)"], opened=False)
        if isinstance(exc, MissingConfigError):
            raise
        return VerifyReport(Path(path), "", problems=[str(exc)], opened=False)
    # The files, checked the format's way (its hook); the report names the directory that check covers (a
    # MaxText output's root, where its manifest is).
    files = fmt.check_files(source)
    root = files.root
    report = VerifyReport(root, files.description, problems=list(files.problems), unlisted=files.unlisted,
                          strict=strict)
    finite = FiniteCheck(str(root))
    tensors = source.tensors()
    while True:
        try:  # opening the next tensor may read its file too
            tensor = next(tensors)
        except StopIteration:
            break
        except DamagedFilesError:  # a damaged file, listed above from this same check
            break
        except CheckpointError as exc:
            report.problems.append(f"{exc} (tensor checks stopped here)")
            break
        for state in (s for s in tensor.states if s not in tensor.scalars):
            try:
                value = finite.check(tensor.name, state, tensor.load_tensor(state))
            except DamagedFilesError:  # what the read failed on is a damaged file, listed above
                continue
            except CheckpointError as exc:  # an unreadable file: report it with the others
                report.problems.append(str(exc))
                continue
            report.tensors += 1
            if tuple(value.shape) != tuple(tensor.shape):
                report.problems.append(f"{root}: {tensor.name} ({state}) has shape {list(value.shape)}, the "
                                       f"checkpoint's metadata says {list(tensor.shape)}")
            if not value.is_floating_point():
                report.problems.append(f"{root}: {tensor.name} ({state}) is {value.dtype}, not a floating-point "
                                       "tensor")
    report.problems += [f"{root}: {name} ({'/'.join(states)}) has NaN/Inf" for name, states in finite.offenders.items()]
    mismatch = fmt.check_model(source)
    if mismatch:
        report.problems.append(f"{root}: {mismatch}")
    return report


def _manifest_problems(fmt: Format, path: Path) -> list[str]:
    """The problems the manifest of a checkpoint at ``path`` finds (none where the format checks its files its own
    way, which needs the source open, or where there is no manifest to check)."""
    from deepspeed_ext.checkpoint.manifest import MANIFEST_FILE, manifest_files_checked
    if fmt.files_check is not None:
        return []
    roots = [path, *([fmt.files_root(path)] if fmt.files_root is not None else [])]  # given the root, or inside it
    root = next((candidate for candidate in roots if (candidate / MANIFEST_FILE).is_file()), None)
    return [] if root is None else list(manifest_files_checked(root).problems)
