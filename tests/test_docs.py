"""Every command the README and docs/ quote is checked, so that none rots.

A command is a line of a ```bash block, or an inline code span that calls ``coordprep`` or
``.venv/bin/python``. Each is checked the cheapest way that still fails when the command breaks:
quick ones run; long ones (a sweep, the bench, an analysis) run with ``--dry-run``, which validates
their files; usage lines (``coordprep sweep FILE [--resume]``) parse with the real argument parser.
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from coordinated_prep.cli import build_parser, main
from tests.conftest import REPO

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
SUBCOMMANDS = ("sweep", "analyze", "memory", "bench", "echo", "dashboard", "convert", "clean")
#: Placeholders of usage lines, and what stands in for them.
PLACEHOLDERS = {"FILE": "experiments/default.yaml", "SRC": "builtin:shapes", "OUT": "out", "PATH": "out.json",
                "DIR": "out", "N": "2"}
#: Commands a test elsewhere runs for real (they need a cluster or take minutes), and that test.
ELSEWHERE = {"coordprep dashboard": "tests/test_metrics.py::test_every_dashboard_panel_has_series_and_what_did_not_happen_has_zeros",
             "curl -s 127.0.0.1:8080/metrics | grep coordprep":
                 "tests/test_metrics.py::test_metrics_are_scraped_during_a_sweep_with_plausible_values"}
DRY_RUN = ("sweep", "analyze", "memory", "bench", "echo")  # long: --dry-run validates the file


def quoted_commands() -> list[tuple[str, str]]:
    """(file, command) for every command the docs quote, with loops expanded and comments dropped."""
    found = []
    for name in DOCS:
        text = open(os.path.join(REPO, name), encoding="utf-8").read()
        lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
        lines += re.findall(r"`([^`\n]*\b(?:coordprep (?:" + "|".join(SUBCOMMANDS) + r")|\.venv/bin/python)\b[^`\n]*)`",
                            text)
        lines += re.findall(r"`((?:curl|ray|pip install) [^`\n]*)`", text)
        for line in lines:
            line = line.split("  #")[0].strip()
            if not line or line.startswith("#"):
                continue
            loop = re.fullmatch(r"(?:cd \S+ && )?for (\w+) in ([\w ]+); do (.*?); done", line)
            if loop:
                var, values, body = loop.groups()
                found += [(name, body.replace(f"${var}", v)) for v in values.split()]
            else:
                found.append((name, line))
    return found


def _commands(line: str) -> list[str]:
    """The commands of a shell line: ``a && b`` is two; ``time`` and ``.venv/bin/`` are dropped."""
    if line in ELSEWHERE:
        return [line]
    out = []
    for part in line.split("&&"):
        part = part.strip().removeprefix("time ").replace(".venv/bin/", "").replace("/path/to/experiments/",
                                                                                   "experiments/")
        out.append(part)
    return out


COMMANDS = quoted_commands()


def test_the_docs_quote_commands_and_every_one_is_recognised():
    assert len(COMMANDS) > 30, COMMANDS
    for name, line in COMMANDS:
        for command in _commands(line):
            assert command.startswith(("coordprep", "python -m pytest", "bash .ci/setup", "ray ", "pip install", "curl")) \
                or command in ELSEWHERE, (name, command)


@pytest.mark.parametrize("name, line", COMMANDS, ids=[f"{n}:{c[:60]}" for n, c in COMMANDS])
def test_every_quoted_command_works(name, line, tmp_path, monkeypatch, capsys):
    for command in _commands(line):
        if command == "bash .ci/setup":
            assert os.path.isfile(os.path.join(REPO, ".ci", "setup"))
            continue
        if command.startswith("python -m pytest"):
            _check_pytest(command)
            continue
        if command in ELSEWHERE:
            path, test = ELSEWHERE[command].split("::")
            assert f"def {test}(" in open(os.path.join(REPO, path)).read(), f"{name}: {command}: {test} is gone"
            continue
        if command.startswith("ray "):  # Ray's own command line: the (sub)command exists
            from ray.scripts.scripts import cli

            group = cli
            for word in shlex.split(command)[1:]:
                assert word in group.commands, f"{name}: {command}: Ray's CLI has no {word!r}"
                group = group.commands[word]
            continue
        if command.startswith("pip install"):  # the extras named exist
            pyproject = open(os.path.join(REPO, "pyproject.toml")).read()
            for extra in re.findall(r"coordinated-prep\[(\w+)\]", command):
                assert re.search(rf"^{extra} = \[", pyproject, re.M), f"{name}: no extra {extra!r} in pyproject.toml"
            continue
        argv = shlex.split(command)[1:]  # after "coordprep"
        usage = any(token in PLACEHOLDERS or token.startswith("[") for token in argv)
        if usage or argv[1:] == [] and argv[0] in ("sweep", "analyze", "memory", "convert"):
            _check_usage(argv, tmp_path)
        elif " ".join(["coordprep", *argv]) in ELSEWHERE:
            nodeid = ELSEWHERE[" ".join(["coordprep", *argv])]
            path, test = nodeid.split("::")
            assert f"def {test}(" in open(os.path.join(REPO, path)).read(), f"{name}: {command}: {nodeid} is gone"
        elif argv[0] in DRY_RUN:
            assert main([*argv, "--dry-run"]) == 0, f"{name}: {command}"
            assert "valid" in capsys.readouterr().out
        else:  # quick: run it for real, in a scratch directory
            monkeypatch.chdir(tmp_path)
            assert main(argv) == 0, f"{name}: {command}: {capsys.readouterr().err}"


def _check_usage(argv: list[str], tmp_path) -> None:
    """A usage line parses with the real parser, each optional part included, placeholders filled."""
    if len(argv) == 1:  # a bare reference to a subcommand: it must exist
        assert argv[0] in SUBCOMMANDS
        return
    tokens = [PLACEHOLDERS.get(t.strip("[]"), t.strip("[]")) for t in argv]
    tokens = [str(tmp_path / t) if t in ("out", "out.json") else t for t in tokens]
    build_parser().parse_args(tokens)  # SystemExit (an unknown option) fails the test


def _check_pytest(command: str) -> None:
    """A quoted pytest run: its files exist, and a marker it selects is registered and used there."""
    args = shlex.split(command)[3:]
    files = [a for a in args if a.endswith(".py")]
    for f in files:
        assert os.path.isfile(os.path.join(REPO, f)), f
    if "-m" in args:
        marker = args[args.index("-m") + 1]
        assert marker in open(os.path.join(REPO, "pyproject.toml")).read()
        assert all(f"mark.{marker}" in open(os.path.join(REPO, f)).read() for f in files)
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    if not files and "-m" not in args:  # the test command of the README is the one CI runs
        assert command.replace("python", ".venv/bin/python") in ci


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_point_at_files_and_headings_that_exist():
    checked = 0
    for name in DOCS:
        text = open(os.path.join(REPO, name), encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)#\s]+\.md)?(#[\w\-]+)?\)", text):
            path, anchor = target
            if not path and not anchor:
                continue
            file = os.path.normpath(os.path.join(REPO, os.path.dirname(name), path)) if path else os.path.join(REPO, name)
            assert os.path.isfile(file), f"{name}: link to {path}, which does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", open(file, encoding="utf-8").read(), re.M)
                assert anchor[1:] in {_slug(h) for h in headings}, f"{name}: no heading for {path}{anchor}"
            checked += 1
    assert checked >= 8


def test_the_readme_is_short():
    assert len(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().splitlines()) <= 200
