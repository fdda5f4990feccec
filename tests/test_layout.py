"""The package's layout: no import circles, files of one idea, and every path that moved still importable
(what users wrote, and what Tune pickled into experiments saved before the move)."""

from __future__ import annotations

import ast
import importlib
import os
import shutil

import pytest
import ray.cloudpickle
from ray import tune

from coordinated_prep import _MOVED as MOVED_MODULES
from coordinated_prep import CoordinatedSearcher, train_loader
from tests.conftest import REPO, live_coordprep_actors, settled

FIXTURE = os.path.join(REPO, "tests", "data", "before_move")  # written by main at 39c0644, before the move
PACKAGES = ("coordinated_prep", "trainables")
MOST_LINES = 400  # "files under about 400 lines" (../STYLE.md), counted past the module docstring


def _modules() -> dict[str, str]:
    """Every module of the packages, by dotted name, with its path."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


def _imports_at_load(path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that ``path`` imports when it loads (top level, not inside functions
    nor under ``TYPE_CHECKING``): the edges along which an import circle can fail."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                names = [f"{sub.module}.{a.name}" for a in sub.names]
                out |= {n for n in names if n in modules} or ({sub.module} & set(modules))
            elif isinstance(sub, ast.Import):
                out |= {a.name for a in sub.names} & set(modules)
    return out


def test_no_module_of_the_package_imports_itself_back_through_others():
    modules = _modules()
    graph = {name: _imports_at_load(path, modules) for name, path in modules.items()}
    # A package imports its submodules' parents implicitly: an edge to "a.b.c" also loads "a.b".
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # A package's __init__ importing its own submodules is no circle of two ideas; anything else is.
    real = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not real, f"import circles: {real}"


def _lines_past_the_docstring(path: str) -> int:
    """Lines of a module after its docstring: where a module writes down its rules, they don't count."""
    text = open(path, encoding="utf-8").read()
    tree = ast.parse(text)
    first = tree.body[0] if tree.body else None
    skip = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    return len(text.splitlines()) - skip


def test_no_file_of_the_package_holds_more_than_one_room():
    too_long = {os.path.relpath(p, REPO): n for p in _modules().values()
                if (n := _lines_past_the_docstring(p)) > MOST_LINES}
    assert not too_long, f"files over {MOST_LINES} lines: {too_long}"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_every_moved_path_is_the_same_module_as_its_new_one(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED_MODULES[old])


def test_the_package_root_holds_only_the_shared_vocabulary_and_the_commands():
    root = sorted(n for n in os.listdir(os.path.join(REPO, "coordinated_prep")) if n.endswith(".py"))
    assert root == ["__init__.py", "cli.py", "context.py", "contracts.py", "dashboard.py",
                    "errors.py", "metrics.py", "naming.py", "pages.py", "plan.py", "spec.py"], root


def trainable(config):
    loader = train_loader(config, batch_size=16, epochs=1)
    tune.report({"seen": sum(len(batch.labels) for batch in loader), "lr": config["lr"]})


def test_an_experiment_saved_before_the_move_restores(ray_session, tmp_path):
    saved = shutil.copytree(FIXTURE, tmp_path / "before_move")
    state = ray.cloudpickle.load(open(saved / "tuner.pkl", "rb"))  # the searcher, by its old class path
    searcher = state["_tune_config"].search_alg
    assert type(searcher).__module__ == "coordinated_prep.tune.searcher", type(searcher)

    restored = tune.Tuner.restore(str(saved), trainable=trainable, resume_unfinished=True, resume_errored=True)
    results = restored.get_results()
    assert len(results) == 2 and not results.errors
    assert sorted(r.metrics["lr"] for r in results) == [0.01, 0.1]
    assert {r.metrics["seen"] for r in results} == {2700}  # what the trials read before the move
    fitted = restored.fit()  # nothing left to run: the restored state is complete
    assert len(fitted) == 2 and not fitted.errors
    # Tune's restored copy of the searcher started this job's registry: a twin attaches and closes it,
    # as coordprep sweep --resume does, so that no later sweep of the session finds it.
    twin = CoordinatedSearcher()
    if twin.attach():
        twin.close()
    assert settled(live_coordprep_actors, []) == []
