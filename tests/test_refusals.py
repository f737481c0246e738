"""Refusals a newcomer meets (issue 51, item 1): each is one line on stderr with a non-zero exit, made before
PyTorch, Optuna or SciPy is imported (the seconds those take are what made a refusal slow; judged by the modules
loaded, not by a clock, since the test machine is shared: experiments/refusal_times.py measures the times), and
every command a refusal suggests runs as printed (cheap ones run, the others are parsed with --help appended).
Also: a worker never makes a storage file and says what it waits for; a missing PostgreSQL driver names the extra.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "experiments" / "data" / "perseus" / "bloom+a100_sxm_bf16.csv"  # Perseus's, 8 stages
TABLE = REPO / "experiments" / "transfer" / "source-kernel-table.json"  # gpt3-xl on the H100, written by a search
HF_LLAMA = REPO / "tests" / "data" / "hf" / "llama"
HEAVY = ("torch", "optuna", "scipy")

# Runs freqopt.cli.main on argv (JSON) with the modules named in FREQOPT_TEST_BLOCK made unimportable (a driver that
# is "not installed"), then prints the exit code and which of HEAVY were imported, as JSON on the last stdout line.
_RUN = """
import json, os, sys
for name in filter(None, os.environ.get("FREQOPT_TEST_BLOCK", "").split(",")):
    sys.modules[name] = None
from freqopt.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)  # fmt: skip

# (argv, a part of the message). {tmp}: the test's folder. The files there: missing.* (absent), corrupt.json (not
# JSON), foreign.json (JSON but not a clock table).
REFUSALS = [
    (["plan", "--stage-profile", "{tmp}/missing.csv", "--micro-batches", "4"], "--stage-profile"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "0"], "--micro-batches must be a positive integer"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--gpu", "a40", "--max-slowdown", "abc"],
     "--max-slowdown 'abc' is not a slowdown"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--schedule", "nope"], "--schedule 'nope'"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--gpu", "nope"], "--gpu 'nope' is unknown"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--gpu", "a40", "--stages", "3"],
     "--stages 3 is not the stage profile's 8 stages"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--blocking-power-w", "80", "--gpu", "nope"],
     "unknown GPU 'nope'"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--gpu", "a40", "--node-limit", "-1"],
     "--node-limit must be an integer >= 0"),
    (["plan", "--stage-profile", str(PROFILE), "--micro-batches", "4", "--gpu", "a40", "--frontier-points", "0",
      "--json", "{tmp}/plan.json"], "--frontier-points must be a positive integer"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "0%"], "--max-slowdown '0%' must be above 0"),
    (["search", "--model", "gpt4", "--max-slowdown", "1%"], "unknown model 'gpt4'"),  # `freqopt models` runs
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "pp=0"], "--layout 'pp=0'"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "dp=abc"], "--layout 'dp=abc'"),
    (["search", "--model", "hf:{tmp}/missing", "--max-slowdown", "1%"], "no Hugging Face config"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--storage", "nope://x"],
     "cannot open Optuna storage 'nope://x' (no database dialect 'nope'"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--storage", "journal:{tmp}/missing/s.journal"],
     "no folder"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--granularity", "nope"], "unknown granularity"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "pp=2", "--micro-batches", "0"],
     "--micro-batches must be a positive integer"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "pp=2", "--micro-batches", "4",
      "--granularity", "nope"], "--granularity 'nope' is not searched on a pipeline"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "pp=2", "--micro-batches", "4",
      "--schedule", "nope"], "--schedule 'nope' is unknown"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "pp=2", "--micro-batches", "4",
      "--storage", "nope://x"], "cannot open Optuna storage"),
    (["train", "--model", "gpt3-small", "--layout", "pp=0"], "--layout 'pp=0'"),
    (["train", "--model", "gpt3-small", "--layout", "dp=abc"], "--layout 'dp=abc'"),
    (["train", "--model", "gpt3-small", "--layout", "pp=2", "--micro-batches", "0"],
     "--micro-batches must be a positive integer"),
    (["train", "--model", "gpt3-small", "--table", "{tmp}/corrupt.json"], "is not valid JSON"),
    (["train", "--model", "gpt3-small", "--table", "{tmp}/foreign.json"], "is not a freqopt clock table"),
    (["train", "--model", "gpt3-small", "--gpu", "nope"], "unknown GPU 'nope'"),
    # a table for gpt3-xl trained on another model, or at another sequence length or layout (certain before the
    # model is built; the suggested transfer runs, test_every_suggestion_runs_as_printed)
    (["train", "--model", "gpt3-small", "--table", str(TABLE)], "lay it onto this workload with `freqopt transfer"),
    (["train", "--model", "gpt3-xl", "--table", str(TABLE), "--seq-len", "128"], "not gpt3-xl dp=1,tp=1"),
    (["train", "--model", "gpt3-xl", "--table", str(TABLE), "--layout", "dp=2"], "not gpt3-xl dp=2,tp=1"),
    (["transfer", "--table", "{tmp}/corrupt.json", "--model", "gpt3-small"], "is not valid JSON"),
    (["transfer", "--table", "{tmp}/foreign.json", "--model", "gpt3-small"], "is not a freqopt clock table"),
    (["transfer", "--table", str(TABLE), "--model", "gpt3-small", "--layout", "pp=0"], "--layout 'pp=0'"),
    (["transfer", "--table", str(TABLE), "--model", "gpt3-small", "--layout", "dp=abc"], "--layout 'dp=abc'"),
    (["transfer", "--table", str(TABLE), "--model", "gpt3-small", "--storage", "nope://x"],
     "cannot open Optuna storage"),
    (["transfer", "--table", str(TABLE), "--model", "hf:{tmp}/missing"], "no Hugging Face config"),
    (["models", "nope"], "unknown model 'nope'"),
    (["models", "--layout", "pp=0"], "--layout 'pp=0'"),
    (["benchmark", "--model", "gpt3-small", "--granularity", "nope"], "--granularity 'nope'"),
    (["benchmark", "--model", "gpt3-small", "--layout", "dp=abc"], "--layout 'dp=abc'"),
    (["powercap", "--model", "gpt3-small", "--caps", "abc"], "--caps 'abc' is not a list of watts"),
    (["powercap", "--model", "gpt3-small", "--layout", "pp=0"], "--layout 'pp=0'"),
    (["profile", "--model", "gpt3-small", "--layout", "pp=0"], "--layout 'pp=0'"),
    (["worker", "--storage", "journal:{tmp}/typo.jounral"], "no freqopt search is running in journal:"),
    (["worker", "--storage", "journal:{tmp}/typo.jounral", "--study", "s"], "no freqopt search named 's' in"),
    (["worker", "--storage", "sqlite:///{tmp}/typo.db"], "(no file"),
    (["worker", "--storage", "sqlite:///{tmp}/missing/w.db"], "no folder"),
    (["worker", "--storage", "nope://x"], "cannot open Optuna storage"),
    (["worker", "--storage", "journal:{tmp}/w.journal", "--wait-s", "-1"], "--wait-s must not be negative"),
    (["worker", "--storage", "journal:{tmp}/w.journal", "--backend", "nope"], "unknown backend 'nope'"),
    (["plan", "--micro-batches", "4"], "Missing option '--stage-profile'"),  # click's, with `freqopt plan --help`
    (["worker", "--wait-s", "1"], "Missing option '--storage'"),
]  # fmt: skip


def _files(tmp: Path) -> None:
    (tmp / "corrupt.json").write_text("{not json")
    (tmp / "foreign.json").write_text('{"a": 1}\n')


def _run(argv: list[str], tmp: Path, block: str = "") -> tuple[dict, str]:
    """freqopt.cli.main(argv) in a fresh interpreter of this tree (cwd ``tmp``): (its _RUN report, its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "FREQOPT_TEST_BLOCK": block}
    proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(argv)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # the interpreter itself; main's exit code is in the report
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _said(err: str) -> str:
    """``err`` without the lines that a slow stage of ``freqopt train`` adds on a loaded machine ("  ... checking
    the run: ... (10 s)", its heartbeat every 10 s), which repeat what it is doing and are no part of a refusal."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("  ... "))


def _suggestions(message: str) -> list[list[str]]:
    """The freqopt commands a message suggests (in backquotes), split as a shell would, without ``freqopt``."""
    return [shlex.split(c)[1:] for c in re.findall(r"`(freqopt [^`]+)`", message)]


# Suggested commands that finish in a second or two, so a test runs them as printed: the lists of GPU types and
# models (the error of an unknown name suggests them), each with its own options.
_FAST_COMMANDS = ("gpus", "models")


def _runs_as_printed(args: list[str], tmp: Path) -> None:
    """A suggested command runs: the fast ones (_FAST_COMMANDS) and any --help as printed, and must exit 0; the
    others, whose run is long (a search, a transfer: 38 s on a loaded 2-core machine, a worker that waits) or needs
    PyTorch, parsed by the command line with --help appended, which refuses an unknown command or option (a
    suggestion that does not run) with exit status 2."""
    from freqopt.cli import main

    cheap = (bool(args) and args[0] in _FAST_COMMANDS) or "--help" in args
    old = os.getcwd()
    os.chdir(tmp)
    try:
        assert main(args if cheap else [*args, "--help"]) == 0, args
    finally:
        os.chdir(old)


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", REFUSALS, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in
                                                           enumerate(REFUSALS)])  # fmt: skip
def test_a_refusal_is_one_line_before_any_heavy_import(tmp_path, argv, message, capsys):
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    report, err = _run(argv, tmp_path)
    err = _said(err)
    assert report["code"] != 0, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("freqopt: error: ") and message in err, err
    assert report["heavy"] == [], f"{argv} imported {report['heavy']} before refusing"
    for args in _suggestions(err):  # every command it suggests runs as printed
        _runs_as_printed(args, tmp_path)
    capsys.readouterr()
    # a storage file is never made by a refusal
    assert not any(p.name.startswith("typo") or p.suffix in (".journal", ".db") for p in tmp_path.iterdir())


@pytest.mark.parametrize("url", ["postgresql+psycopg://user@localhost/freqopt", "postgresql://user@localhost/f"])
def test_a_missing_postgresql_driver_names_the_extra(tmp_path, url):
    """The driver is made unimportable (as if not installed): search and worker refuse the URL at once, in one line
    that says how to install the driver (freqopt.errors.install_hint("postgres"))."""
    for argv in (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--storage", url],
                 ["worker", "--storage", url]):  # fmt: skip
        report, err = _run(argv, tmp_path, block="psycopg,psycopg2")
        assert report["code"] == 2 and report["heavy"] == [], (report, err)
        assert len(err.strip().splitlines()) == 1 and "pip install 'psycopg[binary]>=3.1' (or pip install -e " \
            "'.[postgres]' in the freqopt checkout)" in err, err


def _tensor_parallel_table(tmp: Path) -> Path:
    """TABLE as if transferred to dp=2,tp=2 (what ``freqopt transfer ... --layout dp=2,tp=2`` writes)."""
    data = json.loads(TABLE.read_text())
    data["workload"]["layout"] = {**data["workload"]["layout"], "dp": 2, "tp": 2}
    path = tmp / "tp-table.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("layout", ["given", "the table's"])
def test_a_tensor_parallel_train_without_transformers_is_refused_before_pytorch(tmp_path, layout):
    """DeepSpeed's AutoTP imports transformers: with it made unimportable, a tp=2 train (its layout given, or its
    table's) is refused in one line saying how to install it, before PyTorch is imported (so before any work)."""
    if layout == "given":
        argv = ["train", "--model", "gpt3-small", "--layout", "dp=2,tp=2", "--small-step"]
    else:
        argv = ["train", "--model", "gpt3-xl", "--table", str(_tensor_parallel_table(tmp_path)), "--small-step"]
    report, err = _run(argv, tmp_path, block="transformers")
    assert report["code"] == 2 and report["heavy"] == [], (report, err)
    assert len(err.strip().splitlines()) == 1 and "--layout dp=2,tp=2: tensor parallelism" in err, err
    assert "needs transformers, not installed: pip install 'transformers>=4.40' (or pip install -e '.[tp]' in the " \
           "freqopt checkout)" in err, err


def test_plan_training_refuses_tensor_parallelism_without_transformers_before_training(monkeypatch):
    """The library's way in: plan_training refuses (argument ``layout``) with transformers not found, and nothing
    trains; with transformers found the same layout passes the check."""
    import importlib.util

    import freqopt.apply.train as train_module
    from freqopt.apply.train_checks import check_layout_packages
    from freqopt.errors import MissingDependencyError
    from freqopt.workload.layout import Layout

    check_layout_packages(Layout(2, 2))  # transformers is installed here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        find_spec(name, *a))  # fmt: skip
    monkeypatch.setattr(train_module, "train", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(MissingDependencyError, match=r"^layout dp=2,tp=2: tensor parallelism .*needs transformers"
                                                     r".*pip install 'transformers>=4\.40'") as e:
        train_module.plan_training("gpt3-small", layout="dp=2,tp=2", small_step=True)
    assert e.value.argument == "layout" and len(str(e.value).splitlines()) == 1
    check_layout_packages(Layout(4, 1))  # data parallelism needs no transformers
    with pytest.raises(MissingDependencyError):
        check_layout_packages(Layout(1, 2))


def test_open_storage_names_the_extra_too(monkeypatch):
    """freqopt.search.storage.open_storage (the library's way in) refuses the same way, before SQLAlchemy."""
    from freqopt.errors import MissingDependencyError
    from freqopt.search.storage import open_storage

    monkeypatch.setitem(sys.modules, "psycopg", None)
    hint = r"pip install 'psycopg\[binary\]>=3.1' \(or pip install -e '\.\[postgres\]' in the freqopt checkout\)$"
    with pytest.raises(MissingDependencyError, match=r"psycopg, which is not installed: " + hint):
        open_storage("postgresql+psycopg://user@localhost/freqopt")


def test_storage_urls_are_checked_without_opening_them(tmp_path):
    from freqopt.errors import StorageError
    from freqopt.storage_url import check_storage_url, storage_file

    assert storage_file(f"journal:{tmp_path}/a.journal") == tmp_path / "a.journal"
    assert storage_file(f"sqlite:///{tmp_path}/a.db") == tmp_path / "a.db"  # an absolute path: four slashes
    assert storage_file("sqlite:///a.db") == Path("a.db") and storage_file("sqlite://") is None
    assert storage_file("postgresql+psycopg://u@h/db") is None and storage_file(None) is None
    for url in (f"journal:{tmp_path}/a.journal", f"sqlite:///{tmp_path}/a.db", None):
        check_storage_url(url)
    for url, reason in (("journal:", "no file after journal:"), ("nope://x", "no database dialect 'nope'"),
                        ("a path", "not journal:PATH"), (f"journal:{tmp_path}/no/a.journal", "no folder")):  # fmt: skip
        with pytest.raises(StorageError, match=re.escape(reason)):
            check_storage_url(url)
    assert list(tmp_path.iterdir()) == []


def test_a_worker_waits_only_when_asked_and_says_what_for(tmp_path, monkeypatch):
    """Without wait_s a storage without the search is refused at once; with it, the worker waits, never making the
    file, and calls on_wait at once and then every WAIT_NOTICE_S (shortened here) with what it waits for."""
    import time

    import freqopt.worker as worker
    from freqopt.errors import StorageError

    url = f"journal:{tmp_path / 'later.journal'}"
    started = time.monotonic()
    with pytest.raises(StorageError, match="no freqopt search is running in journal:.*no file"):
        worker.join_search(url)
    assert time.monotonic() - started < 5  # at once: no wait loop (the bound only guards a hung test)
    monkeypatch.setattr(worker, "WAIT_NOTICE_S", 0.1)
    seen = []
    with pytest.raises(StorageError, match=r"no freqopt search named 's' in .* after 0.5 s"):
        worker.join_search(url, "s", wait_s=0.5, poll_s=0.02, on_wait=lambda what, s: seen.append((what, s)))
    assert len(seen) >= 3 and seen[0][1] < 0.1, seen
    assert all(what == f"freqopt search 's' to create {tmp_path / 'later.journal'}" for what, _ in seen)
    assert [s for _, s in seen] == sorted(s for _, s in seen)
    assert not (tmp_path / "later.journal").exists()


@pytest.mark.slow
def test_a_worker_refuses_a_database_without_a_search_at_once(tmp_path):
    """An SQLite storage that exists but holds no freqopt search (another program's study): refused at once."""
    import optuna

    url = f"sqlite:///{tmp_path / 'other.db'}"
    optuna.create_study(study_name="not-a-search", storage=url)
    report, err = _run(["worker", "--storage", url], tmp_path)
    assert report["code"] == 2 and f"no freqopt search is running in {url}" in err, err
    assert len(err.strip().splitlines()) == 1
    for args in _suggestions(err):
        _runs_as_printed(args, tmp_path)


@pytest.mark.slow
def test_a_worker_told_to_wait_says_so_every_10_s_then_gives_up(tmp_path):
    """``freqopt worker --wait-s`` on a journal that does not exist yet: a "waiting for" line at once (and every
    10 s: test_a_worker_waits_only_when_asked_and_says_what_for), then one error line; no file made."""
    report, err = _run(["worker", "--storage", f"journal:{tmp_path}/later.journal", "--wait-s", "1"], tmp_path)
    lines = err.strip().splitlines()
    assert report["code"] == 2 and len(lines) == 2, err
    assert lines[0].startswith("waiting for a freqopt search to create ") and "of --wait-s 1)" in lines[0], err
    assert lines[1].startswith("freqopt: error: no freqopt search is running in journal:") and "after 1 s" in lines[1]
    assert not (tmp_path / "later.journal").exists()


def test_a_hugging_face_table_mismatch_suggests_the_path_given(tmp_path, monkeypatch):
    """Issue 51: the suggested transfer named the model's folder (hf:llama), which no folder holds; it now names
    the path given, made absolute, so that it runs from any folder."""
    from freqopt.errors import TableWorkloadError
    from freqopt.tables import load_table

    monkeypatch.chdir(REPO)
    table = load_table(TABLE)
    target = {"model": "hf:llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 128, "micro_batch_size": 4,
              "layout": {"dp": 1, "tp": 1}}  # fmt: skip
    with pytest.raises(TableWorkloadError) as info:
        table.check_workload(target, model="hf:tests/data/hf/llama")
    (command,) = _suggestions(str(info.value))
    assert command[command.index("--model") + 1] == f"hf:{HF_LLAMA}"
    assert command[command.index("--table") + 1] == str(TABLE)
    _runs_as_printed(command, tmp_path)  # from another folder
    from freqopt.workload.model_names import check_model_name

    monkeypatch.chdir(tmp_path)
    check_model_name(command[command.index("--model") + 1])  # the path is found from there


@pytest.mark.slow
def test_train_with_another_models_table_suggests_a_transfer_that_runs(tmp_path):
    """The whole path through the command line: `freqopt train --model hf:RELATIVE --table T` of another model's
    table suggests `freqopt transfer ... --model hf:ABSOLUTE ...`, which parses from another folder."""
    pytest.importorskip("transformers")
    relative = os.path.relpath(HF_LLAMA, REPO)
    report, err = _run(["train", "--model", f"hf:{relative}", "--table", str(TABLE)], REPO)
    err = _said(err)
    assert report["code"] == 2 and len(err.strip().splitlines()) == 1, err
    (command,) = _suggestions(err)
    assert command[:1] == ["transfer"] and f"hf:{HF_LLAMA}" in command, err
    _runs_as_printed(command, tmp_path)


def test_a_joined_worker_with_nothing_to_claim_says_so_every_10_s(monkeypatch):
    """freqopt.search.workers.serve calls on_idle at least every IDLE_NOTICE_S (shortened here) while the search runs
    with nothing to claim, then gives up after idle_s; the worker command prints each as a line."""
    import importlib

    import optuna

    workers = importlib.import_module("freqopt.search.workers")  # (freqopt.search is also a function's name)
    storage = optuna.storages.InMemoryStorage()
    workers.publish_job_doc(storage, "s", {"model": "gpt3-small"})  # running, no queue published yet
    monkeypatch.setattr(workers, "IDLE_NOTICE_S", 0.05)
    seen = []
    report = workers.serve(storage, "s", None, None, idle_s=0.4, poll_s=0.01, on_idle=seen.append)
    assert report.idle_timeout and report.units == 0
    assert len(seen) >= 3 and seen == sorted(seen) and all(0.04 < s <= 0.45 for s in seen), seen
    workers.finish_job(storage, "s")
    seen.clear()
    assert not workers.serve(storage, "s", None, None, idle_s=0.4, poll_s=0.01, on_idle=seen.append).idle_timeout
    assert seen == []  # a finished search: no wait at all
