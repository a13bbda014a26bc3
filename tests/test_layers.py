"""The house rules of docs/architecture.md, read from the source: the layers, no import circle, no reaching into
another module's private names, small files and functions.

Imports are read with `ast`, so those inside functions and under `TYPE_CHECKING` count as much as those at the
top of a file: a lazy import hides an arrow from a reader, never from this test.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name -> folder (pyproject's package-dir)
PACKAGES = {"paged_hf": "paged_hf", "paged_hf.kernels": "kernels", "paged_hf.integrations": "integrations"}

#: bottom first; a module imports only from its own layer or the layers below it. A layer is named by the first
#: part of a module's name under paged_hf ("core" for paged_hf.core.scheduler); "__init__" is the package itself.
LAYERS = [
    {"utils", "profiling", "source_layout"},
    {"kernels", "integrations"},
    {"config"},
    {"sampling_params", "outputs", "pooling_params"},
    {"loader"},
    {"core"},
    {"sample"},
    {"multimodal"},
    {"worker"},
    {"beam"},
    {"spec_decode"},
    {"engine"},
    {"hf"},
    {"llm", "llm_stages"},
    {"__init__"},  # the public API: what the server, the CLI and the bench use, as a user would
    {"serving"},
    {"bench"},
    {"entrypoints"},  # the `paged-hf` command: generate, serve, bench, eval-ppl
    {"__main__", "default_model", "server", "ray_serve"},  # `python -m paged_hf` and import paths kept from before
]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """(imported module, name taken from it or None, line) for every import of the project in module `name`."""
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.startswith("paged_hf")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("paged_hf"):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None, node.lineno) if submodule in MODULES else (base, alias.name, node.lineno))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    for i, layer in enumerate(LAYERS):
        if key in layer:
            return i
    raise AssertionError(f"{module}: in no layer of LAYERS; give its folder a place there (and in docs/architecture.md)")


def _edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (an import of a package counts as one of its __init__)."""
    edges = defaultdict(set)
    for name in MODULES:
        for target, _, _ in _imports(name):
            while target not in MODULES:  # `import paged_hf.x.y` where y is a name: the module is paged_hf.x
                target = target.rsplit(".", 1)[0]
            if target != name:
                edges[name].add(target)
    return edges


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_import_runs_up_a_layer():
    upward = [f"{name} ({LAYERS[_layer(name)]}) imports {target} ({LAYERS[_layer(target)]})"
              for name, targets in _edges().items() for target in sorted(targets) if _layer(target) > _layer(name)]
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_no_import_circle():
    edges = _edges()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in MODULES:
        if name not in index:
            visit(name)
    assert not circles, f"import circles: {circles}"


def _private_names_defined(name: str) -> set[str]:
    """_names a module defines: its functions, classes and module-level names, and the attributes its
    classes set on self (`self._ids = ...`) or define (`def _step(self)`)."""
    names = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_names():
    defined = {name: _private_names_defined(name) for name in MODULES}
    owners = defaultdict(set)
    for name, names in defined.items():
        for private in names:
            owners[private].add(name)
    reaching = []
    for name in MODULES:
        for target, taken, line in _imports(name):
            if taken and taken.startswith("_") and not taken.startswith("__"):
                reaching.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {taken} from {target}")
        for node in ast.walk(TREES[name]):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in owners and node.attr not in defined[name]:  # a private of another project module
                reaching.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} reads {ast.unparse(node)} "
                                f"(defined in {', '.join(sorted(owners[node.attr]))})")
    assert not reaching, "private names read across modules:\n" + "\n".join(reaching)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_small(name):
    source = MODULES[name].read_text()
    assert source.count("\n") <= MAX_FILE_LINES, f"{MODULES[name]}: over {MAX_FILE_LINES} lines; split it by concern"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(TREES[name])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{MODULES[name]}: functions over {MAX_FUNCTION_LINES} lines: {long}"
