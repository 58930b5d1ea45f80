"""Every private API of another library is read behind that library's fence, and nowhere else.

An allow-list over the source's AST (docs/architecture.md, "Fences"): outside the fence modules below, no module
reads an ``_attribute`` of an object that is not its own (``x._name`` where ``x`` is not ``self``/``cls``, or
``getattr``/``setattr``/``hasattr``/``delattr`` with a literal ``"_name"``) and no module imports a library's
private or internal module, unless the exact use is in :data:`ALLOWED` with its reason. A new leak fails here
whatever its name; a deny-list of known names would let it pass.
"""

from __future__ import annotations

import ast
import fnmatch

from harness.package import PACKAGE, package_modules


#: One fence per library: the only modules that touch its internals, each with an up-front check of them.
FENCES: dict[str, list[str]] = {
    # check.py's check_installed_deepspeed (run at initialize); autotp_layers' _part names a missing attribute
    "DeepSpeed (engine, optimizers, AutoTP layers)": ["checkpoint.engine_private", "checkpoint.engine_private.*"],
    # zipsave._support (its private writer and _save, probed once); torch_zip: the archive's record names;
    # torch_mapped.unsupported (the private loader it maps files for, checked once)
    "torch (the zip writer, its layout, the mapped load)": ["checkpoint.zipsave", "checkpoint.torch_zip",
                                                            "checkpoint.torch_mapped"],
    # transformers_private.check_installed_transformers; integrations.check_installed_integrations (at enable)
    "transformers and Accelerate": ["checkpoint.transformers_private", "runtime.integrations"],
    # orbax_private.check_orbax_internals (before any read or write)
    "Orbax": ["checkpoint.orbax_private"],
    # groups._backend_class (before a weight group is built): torch's backend classes under new_group, their options
    "torch (process groups of their own)": ["weights.groups"],
    # peft_layers.check_lora_layer (each LoRA layer, before AutoTP shards the model)
    "peft (its LoRA layers' parts)": ["module_inject.peft_layers"],
}

#: Private names used outside a fence, each with why: the standard library's documented exceptions, and the
#: two libraries with no public way to do what is done (the uses are guarded where they are).
ALLOWED: dict[tuple[str, str], str] = {
    ("checkpoint.background", "os._exit"): "documented: end a forked writer without the parent's atexit handlers",
    ("checkpoint.output", "os._exit"): "documented: leave at once after an interrupt, staging swept",
    ("cli.common", "os._exit"): "documented: a --distributed rank leaves without gloo's teardown",
    ("demo.models", "os._exit"): "documented: the demo's worker leaves without the interpreter's teardown",
    ("checkpoint.output", "_instances"): "tqdm keeps its open bars only there; read with getattr and a default, "
                                         "to end a bar's line before an interrupt message",
    ("option_spelling", "parser._actions"): "argparse lists a parser's options and subparsers nowhere public",
    ("option_spelling", "argparse._SubParsersAction"): "argparse: the class of add_subparsers()'s action",
    ("checkpoint.serialization", "pickle._Pickler"): "the standard library's pure-Python pickler (what dill and "
                                                     "cloudpickle subclass): the C pickler's save_global cannot be "
                                                     "overridden; test_serialization compares the files",
}

#: Library modules imported outside the fences: the public ones (everything else of these libraries is a fence's).
PUBLIC_IMPORTS = {
    "torch.distributed", "torch.nn", "torch.nn.functional", "torch.utils.data", "orbax.checkpoint",
    "transformers.trainer_utils",  # get_last_checkpoint, documented for resume_from_checkpoint
    "deepspeed.pipe",  # PipelineModule / LayerSpec, DeepSpeed's documented pipeline API (the demo)
    "deepspeed.runtime.pipe.topology",  # the pipeline topology classes DeepSpeed's pipeline docs use (the demo)
}
LIBRARIES = ("deepspeed", "torch", "transformers", "accelerate", "orbax", "safetensors", "huggingface_hub", "jax",
             "tensorstore", "peft")


def _in_fence(module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, pattern) for patterns in FENCES.values() for pattern in patterns)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[tuple[int, str, str]]:
    """``(line, what, the name allowed by)`` of every private use in ``source``: attributes of objects not the
    module's own (``self``/``cls``), literal private names given to ``getattr`` and kin, private or internal
    library modules imported."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            text = f"{ast.unparse(base)}.{node.attr}"
            found.append((node.lineno, text, text if isinstance(base, ast.Name) else node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and ast.unparse(node.args[0]) not in ("self", "cls")):
            found.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})",
                          node.args[1].value))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if node.module and node.level == 0 else [])
            for name in names:
                parts = name.split(".")
                if parts[0] in LIBRARIES and len(parts) > 1 and (
                        any(_private(part) for part in parts) or name not in PUBLIC_IMPORTS):
                    found.append((node.lineno, f"import {name}", name))
    return found


def test_no_private_api_outside_its_fence():
    offenders = []
    for module, path in sorted(package_modules().items()):
        if _in_fence(module):
            continue
        for line, text, key in private_uses(path.read_text()):
            if (module, key) not in ALLOWED:
                offenders.append(f"deepspeed_ext/{path.relative_to(PACKAGE)}:{line}: {text}")
    assert not offenders, ("private API of another library outside its fence (move it into the fence, "
                           "tests/unit/test_fences.py FENCES, or say why in ALLOWED): " + "; ".join(offenders))


def test_every_allowed_use_and_fence_still_exists():
    # A stale entry would let a later leak of the same name pass unnoticed.
    modules = package_modules()
    for module, key in ALLOWED:
        assert module in modules, module
        assert any(used == key for _, _, used in private_uses(modules[module].read_text())), (module, key)
    for patterns in FENCES.values():
        assert any(fnmatch.fnmatchcase(name, pattern) for name in modules for pattern in patterns), patterns


def test_the_finder_finds_each_kind_of_leak():
    source = ("import deepspeed.runtime.zero.stage3\nfrom orbax.checkpoint._src import x\nimport torch.distributed\n"
              "def f(engine, self):\n    engine._hp_mapping\n    getattr(engine, '_copy', None)\n    self._own\n"
              "    engine.__class__\n")
    assert [text for _, text, _ in private_uses(source)] == [
        "import deepspeed.runtime.zero.stage3", "import orbax.checkpoint._src", "engine._hp_mapping",
        "getattr(engine, '_copy')"]


def test_each_fence_checks_its_library_up_front():
    """Each fence has the function that checks the installed library before anything is read through it."""
    from deepspeed_ext.checkpoint import engine_private, orbax_private, torch_mapped, transformers_private, zipsave
    from deepspeed_ext.runtime import integrations
    assert engine_private.missing_deepspeed_parts() == []
    assert zipsave.supported()
    assert torch_mapped.unsupported() is None
    transformers_private.check_installed_transformers()
    assert integrations.missing_integration_parts() == []
    orbax_private.check_orbax_internals()
