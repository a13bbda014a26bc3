"""The server reads an engine through `EngineFace` (paged_hf/engine/face.py) only, as tests/test_layers.py holds
the imports to the layers: read from the source with `ast`, so a new read of an engine internal fails here before
an engine change breaks a server at run time.

In paged_hf/serving/, an engine is any expression whose last name is `generator` (`generator`, `self.generator`,
`self._generator`, `ctx.engine.generator`): every attribute read on one is a name of the face, no `getattr` takes
one, and the only engine module imported is the face. Both engines implement the face explicitly (a missing
method would make them abstract).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from paged_hf.engine.face import FACE, MUTATING, EngineFace
from paged_hf.engine.generator import ContinuousBatchGenerator
from paged_hf.serving.lockstep import LockstepGenerator

SERVING = Path(__file__).resolve().parents[2] / "paged_hf" / "serving"
SOURCES = {path: ast.parse(path.read_text(), str(path)) for path in sorted(SERVING.rglob("*.py"))}


def _is_engine(node: ast.AST) -> bool:
    """`generator`, `x.generator`, `self._generator`: the names serving gives an engine."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in ("generator", "_generator")


def engine_reads(tree: ast.AST) -> list[tuple[str, int]]:
    """(attribute, line) of every attribute read on an engine, and ("getattr", line) of each getattr on one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            found.append((node.attr, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and _is_engine(node.args[0])):
            found.append(("getattr", node.lineno))
    return found


@pytest.mark.parametrize("path", list(SOURCES), ids=lambda p: str(p.relative_to(SERVING)))
def test_serving_reads_an_engine_through_its_face_only(path):
    outside = [f"line {line}: .{name}" for name, line in engine_reads(SOURCES[path])
               if name not in FACE or name == "getattr"]
    if path.name == "lockstep.py":  # it is an engine: its own `_generator` is the one it wraps, also a face
        outside = [entry for entry in outside if "getattr" not in entry]
    assert not outside, f"{path.name} reads engine internals: {outside}; add what it needs to EngineFace"


@pytest.mark.parametrize("path", list(SOURCES), ids=lambda p: str(p.relative_to(SERVING)))
def test_serving_imports_only_the_face_of_the_engine(path):
    imported = [node.module for node in ast.walk(SOURCES[path]) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("paged_hf.engine")]
    imported += [alias.name for node in ast.walk(SOURCES[path]) if isinstance(node, ast.Import)
                 for alias in node.names if alias.name.startswith("paged_hf.engine")]
    assert set(imported) <= {"paged_hf.engine.face"}, imported


def test_the_check_finds_a_read_of_an_internal():
    """The rule above can fail: a read of the engine's scheduler, or a getattr on it, is found."""
    tree = ast.parse("def f(ctx, generator):\n    ctx.engine.generator.scheduler.running\n"
                     "    getattr(generator, 'config', None)\n    generator.stats()\n")
    assert sorted(name for name, _ in engine_reads(tree)) == ["getattr", "scheduler", "stats"]
    assert {"scheduler", "config"}.isdisjoint(FACE) and "stats" in FACE


@pytest.mark.parametrize("engine", [ContinuousBatchGenerator, LockstepGenerator])
def test_both_engines_implement_the_face_explicitly(engine):
    assert issubclass(engine, EngineFace) and not inspect.isabstract(engine)
    assert set(MUTATING) <= FACE


def test_the_lockstep_engine_mirrors_exactly_the_calls_that_change_an_engine():
    """Every other face call is rank 0's own: mirroring a read would send work to every rank for nothing."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(LockstepGenerator)))
    mirrored = {node.args[0].value for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_mirrored" and node.args and isinstance(node.args[0], ast.Constant)}
    assert mirrored == set(MUTATING)
