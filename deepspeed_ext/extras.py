"""The optional parts of deepspeed-ext and the libraries each needs.

``pip install deepspeed-ext`` is what a DeepSpeed user needs to tag, convert (``to-universal``) and resume:
torch, DeepSpeed, safetensors, numpy, tqdm and google-crc32c. The bridges to other ecosystems are extras, so
their libraries (JAX and Orbax alone are about 570 MB) are installed only by those who use them:

* ``deepspeed-ext[hf]``: Hugging Face checkpoints (``to-hf``, ``from-hf``; transformers checks the config and
  the parameter names). The demo's tiny models are transformers models too.
* ``deepspeed-ext[maxtext]``: MaxText / Orbax checkpoints (``to-maxtext``, ``from-maxtext``, ``reshard-orbax``);
  transformers too, for the model config the families are described by.
* ``deepspeed-ext[trainer]``: the Hugging Face Trainer and Accelerate (docs/trainers.md).
* ``deepspeed-ext[all]``: all of them.

Whether an extra is present is found without importing it (``importlib.util.find_spec``), so the check is free.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

from deepspeed_ext.errors import MissingExtraError

#: Per extra: (the module imported, the distribution pip installs).
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "hf": (("transformers", "transformers"), ),
    "maxtext": (("jax", "jax"), ("orbax.checkpoint", "orbax-checkpoint"), ("tensorstore", "tensorstore"),
                ("ml_dtypes", "ml_dtypes"), ("transformers", "transformers")),
    "trainer": (("transformers", "transformers"), ("accelerate", "accelerate")),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` that cannot be imported here."""
    return [dist for module, dist in EXTRAS[extra] if not _importable(module)]


def pip_command(extra: str) -> str:
    return f"pip install 'deepspeed-ext[{extra}]'"


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` (one line: ``what`` needs ..., and the pip command) unless ``extra``'s
    libraries are importable."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(f"{what} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} "
                                f"not installed: {pip_command(extra)}")


def version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (from its metadata: nothing is imported), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe() -> list[str]:
    """``deepspeed-ext --version``: this package, DeepSpeed and torch, and which extras can be used."""
    lines = [f"deepspeed-ext {version('deepspeed-ext') or 'unknown'}",
             f"DeepSpeed {version('deepspeed') or 'not installed'}, torch {version('torch') or 'not installed'}"]
    for extra in EXTRAS:
        absent = missing(extra)
        lines.append(f"extra {extra}: " + ("installed" if not absent else
                                           f"missing {', '.join(absent)} ({pip_command(extra)})"))
    return lines
