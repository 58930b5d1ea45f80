"""The package's import graph: no circles, and imports run down the layers docs/architecture.md draws.

Every import counts, at module level or inside a function, and under ``TYPE_CHECKING`` too: a lazy import that
climbs a layer is still a dependency that climbs it. The graph is read from the source (``ast``), so the test
needs nothing installed beyond the standard library.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

from harness.package import package_modules


#: Bottom to top; a module may import from its own layer and the layers below. Names are relative to the
#: package ("" is the package itself); a pattern ending in ``.*`` covers a package's modules.
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["errors", "config", "version", "extras", "checkpoint", "checkpoint.faults", "checkpoint.durable", "checkpoint.collective", "checkpoint.torch_zip",
              "checkpoint.states", "checkpoint.deepspeed.keys", "module_inject.layout", "module_inject.upstream"]),
    ("files", ["checkpoint.fingerprint", "checkpoint.zipcheck", "checkpoint.torch_mapped", "checkpoint.serialization",
               "checkpoint.manifest",
               "checkpoint.output", "checkpoint.ranges", "checkpoint.orbax_private", "checkpoint.zarr3_shards",
               "checkpoint.families",
               "checkpoint.families.*", "checkpoint.commit", "checkpoint.zipsave", "checkpoint.locate",
               "checkpoint.metadata", "checkpoint.background", "checkpoint.snapshot", "checkpoint.device_staging",
               "checkpoint.adapters"]),
    ("stream", ["checkpoint.tensor", "checkpoint.source", "checkpoint.model_config", "checkpoint.expert_names",
                "checkpoint.quantization", "checkpoint.float_bits", "checkpoint.multimodal", "checkpoint.writing",
                "checkpoint.transformers_private", "checkpoint.adapter_merge"]),
    ("formats", ["checkpoint.deepspeed", "checkpoint.deepspeed.*", "checkpoint.universal", "checkpoint.universal.*",
                 "checkpoint.hf", "checkpoint.hf.*",
                 "checkpoint.maxtext", "checkpoint.maxtext.*"]),
    ("tools", ["checkpoint.formats", "checkpoint.verify", "checkpoint.compare", "checkpoint.adapter_export"]),
    ("engine", ["checkpoint.engine_private", "checkpoint.engine_private.*", "checkpoint.engine_fingerprints", "checkpoint.restore",
                "module_inject", "module_inject.autotp", "module_inject.adapters_tp", "module_inject.peft_layers",
                "module_inject.tp_collectives", "module_inject.linear_attention_tp", "module_inject.inplace_outputs",
                "module_inject.grouped_attention_tp", "checkpoint.live_module"]),
    ("weights", ["weights", "weights.*"]),
    ("front", ["", "__main__", "runtime", "runtime.*", "api", "cli", "cli.*", "option_spelling", "presets", "demo", "demo.*"]),
]
#: Imports allowed to climb, each with why (the issue that set the budget allows three; there are none).
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}
#: The only modules that read a live DeepSpeed engine's internals (docs/architecture.md).
ENGINE_FENCE = "checkpoint.engine_private"


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (relative names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def add(dotted: str) -> None:
        if dotted != "deepspeed_ext" and not dotted.startswith("deepspeed_ext."):
            return
        target = dotted[len("deepspeed_ext."):] if dotted != "deepspeed_ext" else ""
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = ["deepspeed_ext", *package.split(".")] if package else ["deepspeed_ext"]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                relative = full[len("deepspeed_ext."):] if full.startswith("deepspeed_ext.") else full
                add(full if relative in known else base)
    return out


def _graph() -> dict[str, set[str]]:
    known = package_modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _layer(name: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"deepspeed_ext.{name} is in no layer: add it to LAYERS here and to docs/architecture.md")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_down_the_layers():
    upward = {(name, target) for name, targets in _graph().items() for target in targets
              if _layer(target) > _layer(name)}
    unexplained = sorted(upward - set(UPWARD_ALLOWED))
    assert not unexplained, "imports that climb a layer (docs/architecture.md): " + ", ".join(
        f"{a or 'deepspeed_ext'} -> {b} ({LAYERS[_layer(a)][0]} -> {LAYERS[_layer(b)][0]})" for a, b in unexplained)
    assert len(UPWARD_ALLOWED) <= 3


def test_only_the_fence_reads_live_engine_internals():
    # The attributes DeepSpeed's engine and optimizers keep privately; reading them anywhere but the fence
    # would let a DeepSpeed release break a save or a load deep inside instead of at initialize.
    internals = ("_hp_mapping", "_z3_optimizer", "ds_tensor", "fp32_groups_flat", "fp16_groups",
                 "fp32_partitioned_groups_flat", "_get_fp32_opt_state_partition", "safe_set_local_",
                 "get_tensor_model_parallel_", "checkpoint_engine")
    offenders = []
    for name, path in package_modules().items():
        if name == ENGINE_FENCE or name.startswith(ENGINE_FENCE + ".") or name == "checkpoint.deepspeed.keys":  # keys: the saved files' key names, which
            continue  # DeepSpeed spells like the attributes it saves them from
        text = path.read_text()
        offenders += [f"deepspeed_ext.{name}: {word}" for word in internals if word in text]
    assert not offenders, offenders


#: docs/architecture.md: no module of the package is longer than this.
MAX_MODULE_LINES = 600


def test_no_module_is_over_the_limit():
    long = {name or "deepspeed_ext": n for name, path in package_modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
