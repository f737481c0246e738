"""Install as users install (issue 50, item 1): the built wheel, not an editable checkout, imports, answers --help and
runs a search, its GPU and host files found inside the package."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout and installed (no dependencies: those of the running environment) into a
    folder of its own; python runs without site (-S), so this checkout's editable install cannot answer an import."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist")], check=True, cwd=tmp)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("freqopt-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp / "site"),
                    str(wheel)], check=True, cwd=tmp)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FREQOPT_SEARCH_SPACES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "site"), sysconfig.get_paths()["purelib"],
                                         sysconfig.get_paths()["platlib"]])  # fmt: skip
    return wheel, tmp, env


def run(installed, *args, timeout=600):
    _, tmp, env = installed
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, env=env, cwd=tmp,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_data_file(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "freqopt").rglob("__init__.py")}
    assert packages and all(f"{p}/__init__.py" in names for p in packages)
    for data in [*(ROOT / "search_spaces").glob("*.toml"), *(ROOT / "search_spaces" / "hosts").glob("*.toml")]:
        assert f"freqopt/search_spaces/{data.relative_to(ROOT / 'search_spaces')}" in names


@pytest.mark.slow
def test_the_installed_wheel_imports_answers_help_and_searches(installed):
    _, tmp, _ = installed
    got = run(installed, "-c", "import freqopt, freqopt.api, freqopt.pipeline, freqopt.tables; print(freqopt.__file__)")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip().startswith(str(tmp / "site"))
    script = tmp / "site" / "bin" / "freqopt"
    helped = run(installed, str(script), "--help")
    assert helped.returncode == 0 and "search" in helped.stdout, helped.stderr
    daemon = run(installed, str(tmp / "site" / "bin" / "freqoptd"), "--help")  # the daemon's entry point too
    assert daemon.returncode == 0 and "--check-policy" in daemon.stdout, daemon.stderr
    gpus = run(installed, str(script), "gpus")
    assert gpus.returncode == 0 and "h200-node" in gpus.stdout, gpus.stderr
    searched = run(installed, str(script), "search", "--model", "gpt3-small", "--max-slowdown", "1%",
                   "--granularity", "iteration", "--trials", "4", "--out", str(tmp / "out"))
    assert searched.returncode == 0, searched.stderr[-2000:]
    assert "iteration table:" in searched.stderr + searched.stdout


def test_no_message_names_an_extra_of_freqopt_that_no_index_serves():
    """freqopt is installed from its checkout, so ``pip install 'freqopt[hf]'`` finds nothing: no message or
    docstring in freqopt/ says it; the hints say what to pip install and the checkout's ``pip install -e '.[X]'``."""
    import re

    wrong = re.compile(r"pip install\s+['\"]?freqopt\[")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "freqopt").rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if wrong.search(line)]
    assert not found, found


def test_the_install_hints_name_what_pyproject_extras_install():
    """Each extra a hint names (freqopt.errors.EXTRA_PACKAGES) installs in pyproject.toml what the hint says, so
    that the two ways it gives install the same."""
    import tomllib

    from freqopt.errors import EXTRA_PACKAGES, install_hint

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, packages in EXTRA_PACKAGES.items():
        assert tuple(extras[extra]) == packages, extra
        hint = install_hint(extra)
        assert f"pip install -e '.[{extra}]'" in hint and all(f"'{p}'" in hint for p in packages), hint
    assert install_hint("postgres") == "pip install 'psycopg[binary]>=3.1' (or pip install -e '.[postgres]' in the " \
                                       "freqopt checkout)"
