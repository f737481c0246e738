"""The documentation (issue 38, item 2): the MkDocs site builds with --strict (no broken link to a page, an
experiment's report or a heading; every API reference resolves to a docstring; the command reference is the CLI's
own help, mkdocs-click), and the README stays short enough to read: what freqopt does, the two commands, what the
main job prints, where to go next. The API reference (docs/reference.md) lists every public name of the package,
and the quickstart shows the README's main-job table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    commands = (tmp_path / "site" / "commands" / "index.html").read_text()
    # Every command of the CLI is in the generated reference, with its options.
    from freqopt.cli import cli

    for name, command in cli.commands.items():
        assert f"freqopt {name}" in commands, name
        for option in command.params:
            for flag in option.opts:
                if flag.startswith("--"):
                    assert flag in commands, (name, flag)
    assert (tmp_path / "site" / "experiments" / "schedules" / "report" / "index.html").is_file()
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "straggler_schedules" in reference and "PipelinePlanner" in reference


def test_the_readme_is_short_and_its_two_commands_are_the_ci_s():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    test_command = "pip install torch==2.13.0 && DS_BUILD_OPS=0 pip install -c constraints.txt -e '.[test]' && python -m pytest"
    assert f"    {test_command}\n" in readme and (ROOT / ".ci" / "run").read_text().rstrip().endswith(test_command)
    assert "    pip install torch==2.13.0 && DS_BUILD_OPS=0 pip install -c constraints.txt -e '.[plots]' && freqopt search " \
           "--model gpt3-small --max-slowdown 1%\n" in readme  # fmt: skip


def test_every_model_option_says_it_takes_a_hugging_face_config():
    """Every command's --model takes a model name or hf:PATH (resolve_trace_or_workload), and its help says so."""
    from freqopt.cli import cli

    with_model = {name: next(p for p in c.params if "--model" in p.opts) for name, c in cli.commands.items()
                  if any("--model" in p.opts for p in c.params)}  # fmt: skip
    assert {"search", "transfer", "train", "profile"} <= set(with_model)
    for name, option in with_model.items():
        assert "hf:PATH" in option.help, name



def _documented(path: str) -> list:
    """The objects a ``::: path`` block of docs/reference.md renders: the object at ``path`` (a module's, a class's
    or a function's dotted name), and for a module its public members too (mkdocstrings' filter ``!^_``)."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        break
    if isinstance(obj, type(importlib)):
        return [obj, *(getattr(obj, n) for n in getattr(obj, "__all__", dir(obj)) if not n.startswith("_"))]
    return [obj]


def test_the_api_reference_lists_every_public_name():
    """Every name ``import freqopt`` offers (``freqopt.__all__``: its lazily imported names, freqopt/__init__.py) is
    rendered by a ``::: path`` block of docs/reference.md: a block naming it, under the module that defines it or
    one that imports it, or a block of a whole module holding it."""
    import freqopt

    blocks = re.findall(r"^::: ([\w.]+)\s*$", (ROOT / "docs" / "reference.md").read_text(), flags=re.M)
    assert "freqopt.api.search" in blocks  # the pattern reads the page's blocks
    documented = {id(obj) for block in blocks for obj in _documented(block)}
    missing = [f"{name} (::: {getattr(freqopt, name).__module__}.{name})" for name in freqopt.__all__
               if name != "__version__" and id(getattr(freqopt, name)) not in documented]  # fmt: skip
    assert len(freqopt.__all__) > 20 and not missing, f"docs/reference.md lacks: {', '.join(missing)}"


def _fenced_table(text: str) -> str:
    """The first code block of a page that holds the main job's table (its line of ┏ marks it)."""
    blocks = re.findall(r"^```\n(.*?)^```", text, flags=re.M | re.S)
    return next(block for block in blocks if "┏" in block and "power-cap" in block)


def test_the_quickstart_shows_the_readme_s_main_job_table():
    """docs/quickstart.md explains the main job's table column by column; it shows the README's table (which
    tests/test_search.py holds to the command's output) line for line, title included."""
    readme, quickstart = (ROOT / "README.md").read_text(), (ROOT / "docs" / "quickstart.md").read_text()
    table = _fenced_table(readme)
    assert "iteration" in table
    assert _fenced_table(quickstart) == table, "re-paste the README's table into docs/quickstart.md"
