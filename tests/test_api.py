"""The Python API: freqopt.search, the lazy top-level names, and errors that name arguments."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys

import pytest

import freqopt
from freqopt.errors import InvalidSettingError, OutputError, StorageError, UnknownNameError

SMALL = {"seq_len": 128, "micro_batch_size": 1}  # gpt3-small at one 128-token sequence: seconds to search


def test_import_freqopt_loads_neither_torch_nor_optuna():
    code = ("import sys, freqopt; heavy = [m for m in ('torch', 'optuna', 'numpy', 'scipy', 'freqopt.search', "
            "'freqopt.workload.trace') if m in sys.modules]; print(heavy)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_lazy_names_resolve_and_are_listed():
    from freqopt.workload.models import get_workload
    from freqopt.search import SearchConfig, SearchResult
    from freqopt.tables import ClockTable, load_table

    assert freqopt.get_workload is get_workload and freqopt.load_table is load_table
    assert freqopt.ClockTable is ClockTable and freqopt.SearchConfig is SearchConfig
    assert freqopt.SearchResult is SearchResult and issubclass(freqopt.StorageError, freqopt.FreqoptError)
    assert {"search", "profile", "trace_step", "DVFSRuntime", "get_gpu"} <= set(freqopt.__all__) <= set(dir(freqopt))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        freqopt.nothing_here  # noqa: B018


@pytest.mark.skipif(importlib.util.find_spec("freqopt.workload.step_trace") is None, reason="freqopt.workload.step_trace not merged")
def test_trace_step_is_exported():
    from freqopt.workload.step_trace import trace_step

    assert freqopt.trace_step is trace_step


@pytest.mark.slow
def test_search_stays_the_function_after_the_subpackage_is_imported():
    """Importing a submodule binds it on its package (setattr(freqopt, "search", <module>)); that one binding is
    refused, so freqopt.search and freqopt.profile stay the functions whatever is imported, and in any order."""
    code = ("import freqopt.search.runner, freqopt.measure.profile, freqopt.search.summary, types, freqopt; "
            "from freqopt.search import run_search; from freqopt.search.runner import SearchResult; "
            "import freqopt.api, importlib; p = importlib.import_module('freqopt.measure.profile'); "
            "print(freqopt.search is freqopt.api.search, freqopt.profile is p.profile, "
            "isinstance(freqopt.search, types.FunctionType))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr
    import freqopt.search.runner  # noqa: F401  here too, after freqopt was imported
    from freqopt.api import search

    assert freqopt.search is search and callable(freqopt.search)
    freqopt.other_attribute = 1  # other attributes are set as usual
    assert freqopt.other_attribute == 1
    del freqopt.other_attribute


@pytest.mark.parametrize("latency_ms", [26.0, 1.0])
def test_the_units_announced_are_the_units_reported(latency_ms):
    """SearchStart.n_units (the CLI's progress bar) counts what the search runs: the kernel level's families, also
    where a one-clock step holds the level to the iteration's clock (26 ms switches on this step) and its units are
    searched for the free-switching figure alone (issue 35, item 3)."""
    started, units = [], []
    freqopt.search("gpt3-small", max_slowdown="2%", granularity=["iteration", "pass", "kernel"], n_trials=3,
                   switch_latency_ms=latency_ms, on_start=started.append,
                   on_unit=lambda g, done, n: units.append(g), **SMALL)  # fmt: skip
    assert started[0].n_units == len(units) and "kernel" in units


@pytest.mark.slow
def test_search_a_model_name_writes_tables_and_its_summary_matches_the_cli(tmp_path):
    from freqopt.cli import main

    started = []
    units = []
    result = freqopt.search("gpt3-small", max_slowdown="2%", granularity="iteration", n_trials=4, out=tmp_path / "a",
                            on_start=started.append, on_unit=lambda g, done, n: units.append((g, done, n)),
                            **SMALL)  # fmt: skip
    assert len(started) == 1 and started[0].n_units == len(units) == 1 and units == [("iteration", 1, 1)]
    assert started[0].study_name.startswith("gpt3-small-h100-sxm-") and started[0].backend == "sim"
    summary = result.summary()
    assert summary["results"]["iteration"]["slowdown_pct"] <= 2.0
    path = summary["results"]["iteration"]["table"]
    assert path == str(tmp_path / "a" / "gpt3-small-h100-sxm-2pct-iteration.json")
    assert freqopt.load_table(path).data["entries"] == result.table("iteration").data["entries"]
    assert (tmp_path / "a" / "gpt3-small-h100-sxm-2pct-iteration.csv").exists() and (tmp_path / "a" / "freqopt.journal").exists()
    assert json.loads(json.dumps(summary)) == summary  # JSON as it is

    doc = tmp_path / "cli.json"
    assert main(["search", "--model", "gpt3-small", "--seq-len", "128", "--micro-batch-size", "1", "--max-slowdown",
                 "2%", "--granularity", "iteration", "--trials", "4", "--out", str(tmp_path / "b"), "--json",
                 str(doc)]) == 0  # fmt: skip
    cli = json.loads(doc.read_text())
    assert set(cli) == set(summary) and set(cli["baseline"]) == set(summary["baseline"])
    assert set(cli["results"]) == set(summary["results"])
    assert set(cli["results"]["iteration"]) == set(summary["results"]["iteration"])
    # Same search, same seed, another storage: the same figures.
    assert cli["results"]["iteration"]["energy_saved_pct"] == pytest.approx(
        summary["results"]["iteration"]["energy_saved_pct"])


@pytest.mark.parametrize("verbose", [False, True])
def test_optuna_logs_only_when_verbose_and_the_callers_level_comes_back(small_trace, verbose, optuna_messages):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO)  # Optuna's own default, as a user's process has it
    try:
        freqopt.search(small_trace, max_slowdown=0.02, granularity="iteration", n_trials=3, verbose=verbose)
        assert optuna.logging.get_verbosity() == optuna.logging.INFO
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the suite's level (conftest)
    assert any(m.startswith("A new study created") for m in optuna_messages) is verbose, optuna_messages[:3]


def test_search_a_trace_in_memory_writes_nothing(small_trace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = freqopt.search(small_trace, max_slowdown=0.02, granularity=["pass", "iteration"], n_trials=4, seed=1)
    assert list(result.results) == ["iteration", "pass"]  # coarse to fine, whatever order was given
    assert result.storage is None and result.table_paths == {} and not list(tmp_path.iterdir())
    summary = result.summary()
    assert all(r["table"] is None for r in summary["results"].values())
    # Every measurement is paid by a level: the baseline's by the first.
    assert summary["n_new_measurements"] == sum(r["n_measurements"] for r in summary["results"].values())
    table = result.table("pass")
    assert table.granularity == "pass" and table.data["provenance"]["backend"] == "sim"
    assert table.data["provenance"]["seed"] == 1
    paths = result.write_tables(tmp_path / "later")
    assert set(paths) == {"iteration", "pass"} and all(p.exists() for p in paths.values())
    with pytest.raises(UnknownNameError, match="'kernel' was not searched"):
        result.table("kernel")


BAD = [
    (dict(max_slowdown="abc"), InvalidSettingError, "max_slowdown 'abc' is not a slowdown"),
    (dict(max_slowdown=1.5), InvalidSettingError, "max_slowdown 1.5 is outside"),
    (dict(max_slowdown="1%", n_trials=0), InvalidSettingError, "n_trials must be a positive integer"),
    (dict(max_slowdown="1%", n_jobs=0), InvalidSettingError, "n_jobs must be a positive integer"),
    (dict(max_slowdown="1%", granularity="layer"), UnknownNameError, "unknown granularity 'layer'"),
    (dict(max_slowdown="1%", gpu="rtx9090"), UnknownNameError, "unknown GPU 'rtx9090'"),
    (dict(max_slowdown="1%", backend="tpu"), UnknownNameError, "unknown backend 'tpu'"),
    (dict(max_slowdown="1%", layout="tp=5"), InvalidSettingError, "layout tp=5 does not divide"),
    (dict(max_slowdown="1%", seq_len=0), InvalidSettingError, "seq_len must be a positive integer"),
    (dict(max_slowdown="1%", storage="foo://bar"), StorageError, "cannot open Optuna storage"),
    (dict(max_slowdown="1%", switch_latency_ms=-1), InvalidSettingError, "switch_latency_ms must be a number of milliseconds"),
    (dict(max_slowdown="1%", switch_latency_ms="6"), InvalidSettingError, "switch_latency_ms must be a number of milliseconds"),
    (dict(max_slowdown="1%", switch_latency_ms=float("nan")), InvalidSettingError, "switch_latency_ms must be"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_bad_arguments_name_the_argument_and_write_nothing(kwargs, error, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(error, match=message) as e:
        freqopt.search("gpt3-small", out=out if "storage" not in kwargs else None, **kwargs)
    assert "--" not in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


def test_a_jobs_count_on_a_real_gpu_is_refused_before_it_is_opened():
    with pytest.raises(InvalidSettingError, match="n_jobs > 1 applies to the simulated GPU"):
        freqopt.search("gpt3-small", max_slowdown="1%", backend="nvml", n_jobs=2)


def test_overrides_with_a_trace_are_refused(small_trace):
    with pytest.raises(InvalidSettingError, match="seq_len apply to a model name, not to a Trace"):
        freqopt.search(small_trace, max_slowdown="1%", seq_len=64)


def test_out_is_checked_before_any_work(tmp_path, monkeypatch):
    """An unwritable out fails before tracing: the tracer is never called."""
    import freqopt.api

    blocker = tmp_path / "file"
    blocker.write_text("keep")

    def never(*args, **kwargs):
        raise AssertionError("traced before out was checked")

    monkeypatch.setattr("freqopt.workload.trace.trace_training_iteration", never)
    with pytest.raises(OutputError, match="out .* is a file; give a directory"):
        freqopt.search("gpt3-small", max_slowdown="1%", out=blocker)
    with pytest.raises(OutputError, match="out .*sub: cannot write there .*; choose another directory") as e:
        freqopt.search("gpt3-small", max_slowdown="1%", out=blocker / "sub")
    assert e.value.argument == "out"
    assert blocker.read_text() == "keep"
    assert freqopt.api.check_writable_dir(tmp_path / "new" / "deep") == tmp_path / "new" / "deep"


def test_the_backend_is_closed_even_when_the_search_fails(small_trace, monkeypatch):
    from freqopt.gpu.backends.simulated import SimulatedGPU

    closed = []
    monkeypatch.setattr(SimulatedGPU, "close", lambda self: closed.append(self))

    def fail(*args, **kwargs):
        raise RuntimeError("measurement failed")

    # The subpackage by importlib: as an attribute, freqopt.search is the function (freqopt's module docstring).
    monkeypatch.setattr(importlib.import_module("freqopt.search"), "run_search", fail)
    with pytest.raises(RuntimeError, match="measurement failed"):
        freqopt.search(small_trace, max_slowdown="1%", granularity="iteration")
    assert len(closed) == 1
    given = SimulatedGPU(freqopt.get_gpu("h100-sxm"))  # a Backend passed in is the caller's: not closed
    with pytest.raises(RuntimeError):
        freqopt.search(small_trace, max_slowdown="1%", granularity="iteration", backend=given)
    assert len(closed) == 1


@pytest.mark.parametrize("granularity,error,message", [
    (["iteration", "layer"], UnknownNameError, "unknown granularity 'layer'; choose from all, power-cap, iteration"),
    ([], InvalidSettingError, "granularity is empty; give 'all' or some of power-cap, iteration"),
    (("all", "kernel"), InvalidSettingError, "granularity 'all' stands alone"),
    (5, InvalidSettingError, "granularity must be 'all', a name or a sequence of names"),
])  # fmt: skip
def test_a_bad_granularity_list_is_one_line_naming_the_valid_ones(granularity, error, message):
    with pytest.raises(error, match=message) as e:
        freqopt.search("gpt3-small", max_slowdown="1%", granularity=granularity)
    assert "\n" not in str(e.value)


def test_granularity_takes_all_one_name_or_a_sequence():
    from freqopt.api import _granularities
    from freqopt.search.units import GRANULARITIES

    assert _granularities("all") == _granularities(["all"]) == GRANULARITIES
    assert _granularities("kernel") == _granularities(("kernel",)) == ("kernel",)
    assert _granularities(["phase", "iteration", "phase"]) == ("iteration", "phase")  # coarse to fine, once


def test_errors_carry_the_argument_they_name():
    with pytest.raises(InvalidSettingError) as e:
        freqopt.search("gpt3-small", max_slowdown="1%", n_trials=0)
    assert e.value.argument == "n_trials" and str(e.value) == "n_trials must be a positive integer, not 0"
    assert e.value.naming("--trials") == "--trials must be a positive integer, not 0"
    with pytest.raises(InvalidSettingError) as e:
        freqopt.search("gpt3-small", max_slowdown="1%", layout="dp=x")
    assert e.value.argument == "layout"
    with pytest.raises(UnknownNameError) as e:
        freqopt.search("gpt3-small", max_slowdown="1%", gpu="rtx9090")
    assert e.value.argument is None and e.value.naming("--gpu") == str(e.value)  # a message that names no argument


def test_a_bad_storage_is_found_before_out_is_made(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(StorageError, match="cannot open Optuna storage 'bogus://x'"):
        freqopt.search("gpt3-small", max_slowdown="1%", storage="bogus://x", out=out)
    assert not (tmp_path / "a").exists()


def test_switch_latency_ms_replaces_the_gpu_files_and_reaches_the_validation(small_trace):
    """Issue 22: the override is the latency the schedules are realized with. Instant switches let the kernel level
    be searched; a latency longer than the iteration leaves one setting for all of it, known before measuring
    (issue 25: the level keeps the iteration's clock, unmeasured, and says why)."""
    from freqopt.gpu.backends.simulated import SimulatedGPU

    instant = freqopt.search(small_trace, max_slowdown="1%", granularity="kernel", n_trials=4, switch_latency_ms=0)
    endless = freqopt.search(small_trace, max_slowdown="1%", granularity="kernel", n_trials=4,
                             switch_latency_ms=100_000)  # fmt: skip
    assert instant.spec.clock_switch_s == 0.0 and endless.spec.clock_switch_s == 100.0
    assert instant.results["kernel"].n_measurements > 0 and not instant.results["kernel"].note
    assert endless.results["kernel"].n_settings == 1  # the iteration level's clock, searched as its candidate
    assert "shorter than two 100000 ms clock switches" in endless.results["kernel"].note
    given = SimulatedGPU(freqopt.get_gpu("h100-sxm"))
    result = freqopt.search(small_trace, max_slowdown="1%", granularity="iteration", n_trials=2, backend=given,
                            switch_latency_ms=3)  # fmt: skip
    assert result.spec.clock_switch_s == pytest.approx(0.003)
    assert given.spec.clock_switch_s == freqopt.get_gpu("h100-sxm").clock_switch_s  # the caller's keeps its own


def test_transfer_and_train_take_the_switch_latency_override(monkeypatch):
    import freqopt.apply.train
    from freqopt.apply.transfer import transfer
    from freqopt.apply.train import plan_training

    with pytest.raises(InvalidSettingError, match="^switch_latency_ms must be"):
        transfer("no-such-table.json", "gpt3-small", switch_latency_ms=-1)  # before the table is read
    with pytest.raises(InvalidSettingError, match="^switch_latency_ms must be"):
        plan_training("gpt3-small", switch_latency_ms=-1)
    seen = []
    monkeypatch.setattr(freqopt.apply.train, "train", lambda workload, backend, **kwargs: seen.append(backend.spec))
    plan_training("gpt3-small", steps=1, seq_len=16, micro_batch_size=1, switch_latency_ms=7).run()
    assert seen[0].clock_switch_s == pytest.approx(0.007) and seen[0].name == "h100-sxm"


def test_a_step_that_does_not_fit_is_refused_on_a_real_gpu_and_warned_of_on_the_simulated_one(fake_gpu, tmp_path):
    """Issue 35, item 7: search checks the step's memory per rank as profile does, before any measurement."""
    from freqopt.workload.memory import GPUMemoryWarning

    too_big = {"micro_batch_size": 128, "seq_len": 2048}  # about 106 GB per rank, 105 of them activations
    with pytest.raises(InvalidSettingError, match=r"needs about .* of GPU memory per rank, more than one h100-sxm's"):
        freqopt.search("gpt3-small", max_slowdown="1%", backend="nvml", out=tmp_path / "o", **too_big)
    assert not (tmp_path / "o").exists()
    assert fake_gpu.gpus[0].power_limit_mw == 650_000  # opened, refused, left as found

    class Stop(Exception):
        pass

    def stop(start):
        raise Stop

    with pytest.warns(GPUMemoryWarning, match="searched anyway"), pytest.raises(Stop):
        freqopt.search("gpt3-small", max_slowdown="1%", on_start=stop, **too_big)
