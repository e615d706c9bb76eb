"""The import layering of docs/architecture.md, enforced on every module under services/.

Each package is one layer and imports only its own layer and the ones below it (checked on
every ``import`` statement, module level or inside functions); the import graph has no cycle,
lazy imports included (a lazy import must not hide one); and the engine core, imported alone,
loads no gRPC, protobuf or tokenizer code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"

COMMON, TOKENIZER, CORE = "services.common", "services.tokenizer", "services.engine.core"
RUNTIME, TRANSFER = "services.engine.runtime", "services.engine.kv_transfer"
PREFILL, DECODE, GATEWAY, TOP = "services.prefill", "services.decode", "services.gateway", "services"
LOADGEN = "services.loadgen"

# layer → the layers it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    COMMON: {COMMON},
    TOKENIZER: {COMMON, TOKENIZER},
    CORE: {COMMON, CORE},
    RUNTIME: {COMMON, TOKENIZER, CORE, RUNTIME},
    TRANSFER: {COMMON, CORE, RUNTIME, TRANSFER},
    PREFILL: {COMMON, TOKENIZER, CORE, RUNTIME, TRANSFER, PREFILL},
    DECODE: {COMMON, TOKENIZER, CORE, RUNTIME, TRANSFER, DECODE},
    GATEWAY: {COMMON, TOKENIZER, GATEWAY},
    LOADGEN: {COMMON, TOKENIZER, LOADGEN},
}
ORDER = [COMMON, TOKENIZER, CORE, RUNTIME, TRANSFER, PREFILL, DECODE, GATEWAY, LOADGEN]


def layer_of(module: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    if module == "services.engine":  # the package docstring only
        return CORE
    return TOP  # services.cli, launcher, launch_plan, __main__: the command, above everything


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every services.* module ``path`` imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("services"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("services"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)  # submodules
    return found


def _graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in SERVICES.rglob("*.py") if "pb" not in p.parts}
    return {name: {m for m in imports_of(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_every_import_goes_down() -> None:
    wrong = []
    for name, targets in _graph().items():
        layer = layer_of(name)
        if layer == TOP:
            continue
        wrong += [f"{name} -> {t}" for t in sorted(targets) if layer_of(t) not in ALLOWED[layer]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ importing its own submodules is not a cycle between modules
    cycles = [c for c in cycles if not _package_self_import(c)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _package_self_import(cycle: str) -> bool:
    names = cycle.split(" -> ")
    return all(n.startswith(min(names, key=len)) for n in names) and len(set(names)) == 2


def test_the_engine_core_loads_no_wire_and_no_text() -> None:
    core = sorted(m for m in _graph() if layer_of(m) == CORE)
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in core)
        + "bad = [m for m in sys.modules if m.split('.')[0] == 'grpc' or m.startswith("
        "('google.protobuf', 'services.tokenizer', 'services.engine.runtime', "
        "'services.engine.kv_transfer', 'services.common.pb', 'aiohttp'))]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_layers_are_the_documented_ones() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for layer in ORDER:
        assert f"`{layer.replace('.', '/')}/`" in text, layer
