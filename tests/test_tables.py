import csv
import dataclasses
import json
import os
import stat

import pytest

from freqopt.gpu.backends.base import Measurement
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.errors import ClockTableError, OutputError
from freqopt.gpu.specs import get_gpu
from freqopt.search import SearchConfig, run_search
from freqopt.tables import SCHEMA_VERSION, ClockTable, load_table, table_from_result, write_table, write_table_csv


@pytest.fixture(scope="module")
def result(small_trace):
    config = SearchConfig(max_slowdown=0.02, granularities=("pass",), n_trials_1d=6)
    # 1 ms switches: at the H100's 26 ms this short step realizes one clock, and the pass level is not searched.
    h100 = get_gpu("h100-sxm").with_switch_latency(0.001)
    return run_search(small_trace, SimulatedGPU(h100, seed=0), config)


@pytest.fixture(scope="module")
def table(result):
    return table_from_result(result, "pass", get_gpu("h100-sxm"), backend="sim", seed=0)


@pytest.mark.slow
def test_reprs_are_one_short_line(result, table, small_trace):
    """print(trace), print(table) and repr(result) say what they are in a line, not in tens of kilobytes."""
    trace = repr(small_trace)
    assert len(trace) < 200 and "\n" not in trace and len(str(small_trace)) == len(trace)
    assert trace.startswith("Trace(model='gpt3-small'") and "micro-batch 1 x 256 tokens" in trace
    assert f"{len(small_trace)} kernels" in trace and f"{len(small_trace.kernel_classes())} classes" in trace
    assert "dp=1,tp=1" in trace and "TFLOP" in trace
    text = repr(table)
    assert len(text) < 250 and "\n" not in text
    saved, slowdown = table.data["validated"]["energy_saved_pct"], table.data["validated"]["slowdown_pct"]
    assert text.startswith("ClockTable(gpu='h100-sxm', model='gpt3-small', granularity='pass'")
    assert "max_slowdown=2%" in text and "3 entries" in text
    assert f"validated {0.0 - saved:+.2f} % energy at {slowdown:+.2f} % time" in text
    text = repr(result)
    assert len(text) < 400 and "\n" not in text and "Kernel(" not in text
    assert text.startswith("SearchResult(model='gpt3-small', gpu='h100-sxm', dp=1,tp=1, max_slowdown=2%")
    assert f"pass: {0.0 - result.energy_saved_pct('pass'):+.2f} % energy" in text
    text = repr(result.results["pass"])
    assert len(text) < 250 and text.startswith("GranularityResult(granularity='pass', 3 units")
    assert f"{result.results['pass'].n_measurements} measurements" in text
    # The short reprs leave equality alone: equal data, equal objects.
    assert ClockTable(json.loads(json.dumps(table.data))) == table and dataclasses.replace(small_trace) == small_trace
    assert repr(ClockTable({})).startswith("ClockTable(")  # never raises, even on a document that is no table


def test_a_measured_mean_clock_prints_rounded():
    """A time-weighted mean of a steady clock is 884.9999999999999 in floating point; it prints as 885."""
    assert repr(Measurement(1.0, 2.0, sm_clock_mhz=884.9999999999999)).endswith("sm_clock_mhz=885)")
    assert repr(Measurement(1.0, 2.0, sm_clock_mhz=1893.57908847185)).endswith("sm_clock_mhz=1893.6)")
    assert repr(Measurement(1.0, 2.0)).endswith("sm_clock_mhz=None)")


@pytest.mark.slow
def test_clocks_are_integers_in_the_files(table, tmp_path):
    """A table another tool wrote with 885.0 (JSON Schema's "integer" admits it) loads, and is written again, with
    integer clocks; so are the clocks of a table built from a search."""
    def clocks(data):
        for e in data["entries"]:
            yield from (o[k] for o in (e, e.get("default") or {}, *e.get("front", ())) for k in
                        ("sm_clock_mhz", "mem_clock_mhz") if o.get(k) is not None)  # fmt: skip
        yield from data["gpu"]["sm_clocks_mhz"] + data["gpu"]["mem_clocks_mhz"]

    assert all(type(c) is int for c in clocks(table.data))
    data = json.loads(json.dumps(table.data))
    entry = data["entries"][0]
    entry["sm_clock_mhz"], entry["mem_clock_mhz"] = 885.0, 2619.0
    entry["default"]["sm_clock_mhz"] = 1980.0
    data["gpu"]["sm_clocks_mhz"] = [float(f) for f in data["gpu"]["sm_clocks_mhz"]]
    path = tmp_path / "floats.json"
    path.write_text(json.dumps(data))
    loaded = load_table(path)
    assert all(type(c) is int for c in clocks(loaded.data))
    assert loaded.entries[0]["sm_clock_mhz"] == 885
    text = write_table(loaded, tmp_path / "ints.json").read_text()
    assert '"sm_clock_mhz": 885,' in text and "885.0" not in text and "1980.0" not in text
    rows = list(csv.DictReader(write_table_csv(loaded, tmp_path / "ints.csv").read_text().splitlines()))
    assert (rows[0]["sm_clock_mhz"], rows[0]["mem_clock_mhz"]) == ("885", "2619")


@pytest.mark.slow
def test_round_trip(table, tmp_path):
    path = write_table(table, tmp_path / "t.json")
    loaded = load_table(path, spec=get_gpu("h100-sxm"))
    assert loaded.data == json.loads(json.dumps(table.data))
    assert {e["unit"] for e in loaded.entries} == {"forward", "backward", "optimizer"}
    assert loaded.data["provenance"]["n_measurements"] > 0
    assert not list(tmp_path.glob(".*tmp")), "no temporary file left behind"
    csv_text = write_table_csv(table, tmp_path / "t.csv").read_text().splitlines()
    assert csv_text[0].startswith("unit,") and len(csv_text) == 4


@pytest.mark.slow
def test_truncated_table_is_refused(table, tmp_path):
    path = write_table(table, tmp_path / "t.json")
    path.write_text(path.read_text()[:200])
    with pytest.raises(ClockTableError, match="not valid JSON"):
        load_table(path)


def test_foreign_json_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ClockTableError, match="not a freqopt clock table"):
        load_table(path)


@pytest.mark.slow
def test_other_schema_version_is_refused(table, tmp_path):
    data = dict(table.data, schema_version=SCHEMA_VERSION + 1)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="schema version"):
        load_table(path)


@pytest.mark.slow
def test_corrupt_entry_is_refused(table, tmp_path):
    data = json.loads(json.dumps(table.data))
    data["entries"][0]["sm_clock_mhz"] = "fast"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="corrupt"):
        load_table(path)


@pytest.mark.slow
def test_other_gpu_is_refused(table, tmp_path):
    path = write_table(table, tmp_path / "t.json")
    with pytest.raises(ClockTableError, match="searched on h100-sxm, not a100-sxm4-80gb"):
        load_table(path, spec=get_gpu("a100-sxm4-80gb"))


@pytest.mark.slow
def test_unsupported_clocks_are_refused(table, tmp_path):
    data = json.loads(json.dumps(table.data))
    data["entries"][0]["sm_clock_mhz"] = 1234
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="does not support"):
        load_table(path, spec=get_gpu("h100-sxm"))


@pytest.mark.slow
def test_missing_file_and_unwritable_target(table, tmp_path):
    with pytest.raises(ClockTableError, match="cannot read"):
        load_table(tmp_path / "nope.json")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError):
        write_table(table, blocker / "t.json")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_honour_the_umask(tmp_path, umask, mode):
    from freqopt.files import atomic_write_text

    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "t.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.json").stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


@pytest.mark.parametrize("proc_readable", [True, False])
def test_umask_is_read_without_changing_it(monkeypatch, proc_readable):
    import builtins

    from freqopt import files

    if not proc_readable:  # not Linux: the set-and-put-back fallback
        real_open = builtins.open

        def no_proc(path, *args, **kwargs):
            if str(path) == "/proc/self/status":
                raise OSError("no /proc here")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", no_proc)
    old = os.umask(0o027)
    try:
        assert files._umask() == 0o027
        assert os.umask(0o027) == 0o027  # still the caller's
    finally:
        os.umask(old)


# -- the workload a table was found for ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_table_records_its_workload_and_refuses_another(table, tmp_path):
    from freqopt.errors import TableWorkloadError
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import get_workload

    path = write_table(table, tmp_path / "t.json")
    loaded = load_table(path)
    assert loaded.source == str(path.resolve())
    assert loaded.workload == {"model": "gpt3-small", "n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 256,
                               "micro_batch_size": 1, "layout": {"dp": 1, "tp": 1}}
    loaded.check_workload(get_workload("gpt3-small", micro_batch_size=1, seq_len=256))  # its own: accepted
    for other, fragment in [
        (get_workload("gpt3-medium", micro_batch_size=1, seq_len=256),
         "not gpt3-medium dp=1,tp=1 micro-batch 1 seq 256"),
        (get_workload("gpt3-small", micro_batch_size=4, seq_len=256), "not gpt3-small dp=1,tp=1 micro-batch 4 seq 256"),
        (get_workload("gpt3-small", micro_batch_size=1, seq_len=128), "not gpt3-small dp=1,tp=1 micro-batch 1 seq 128"),
        (get_workload("gpt3-small", micro_batch_size=1, seq_len=256, layout=Layout(dp=2)), "not gpt3-small dp=2,tp=1"),
        (get_workload("gpt3-small", micro_batch_size=1, seq_len=256, n_heads=6), "6 heads"),
    ]:  # fmt: skip
        with pytest.raises(TableWorkloadError) as caught:
            loaded.check_workload(other)
        message = str(caught.value)
        assert fragment in message and "\n" not in message
        assert message.startswith(f"table {path.resolve()} was found for gpt3-small dp=1,tp=1 micro-batch 1 seq 256")
        layout = other.layout
        assert (f"`freqopt transfer --table {path.resolve()} --model {other.model} --layout "
                f"dp={layout.dp},tp={layout.tp} --micro-batch-size {other.micro_batch_size} "
                f"--seq-len {other.config.seq_len}") in message


@pytest.mark.slow
def test_a_table_from_before_layouts_is_read_as_one_gpu_and_one_without_its_sizes_is_refused(table, tmp_path):
    """Tables have recorded model, sizes, micro-batch and sequence length since the format's first version, and
    the layout since parallel layouts: without it a table is a single-GPU one. One that does not record its
    micro-batch (written by hand) loads, but cannot be checked against a workload: refused for training."""
    from freqopt.errors import TableWorkloadError
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import get_workload

    data = json.loads(json.dumps(table.data))
    del data["workload"]["layout"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_table(path)
    assert old.workload["layout"] == {"dp": 1, "tp": 1}
    old.check_workload(get_workload("gpt3-small", micro_batch_size=1, seq_len=256))
    with pytest.raises(TableWorkloadError, match="micro-batch 1 seq 256, not gpt3-small dp=2,tp=1"):
        old.check_workload(get_workload("gpt3-small", micro_batch_size=1, seq_len=256, layout=Layout(dp=2)))
    del data["workload"]["micro_batch_size"], data["workload"]["n_heads"]
    path.write_text(json.dumps(data))
    hand_written = load_table(path)
    with pytest.raises(ClockTableError, match=r"old.json does not record the micro_batch_size it was found for "
                                              r"\(written by hand or edited\).*search again"):
        hand_written.check_workload(get_workload("gpt3-small", micro_batch_size=1, seq_len=256))
    data["workload"]["micro_batch_size"] = 1  # heads not recorded: the model's name stands for them
    path.write_text(json.dumps(data))
    load_table(path).check_workload(get_workload("gpt3-small", micro_batch_size=1, seq_len=256))


@pytest.mark.slow
def test_train_refuses_another_workloads_table_in_one_line_naming_freqopt_transfer(table, tmp_path, capsys):
    from freqopt.cli import main

    path = write_table(table, tmp_path / "t.json")
    for args in (["--model", "gpt3-medium"], ["--model", "gpt3-small", "--micro-batch-size", "2"],
                 ["--model", "gpt3-small", "--layout", "dp=2"]):  # fmt: skip
        assert main(["train", *args, "--table", str(path), "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "was found for gpt3-small dp=1,tp=1 micro-batch 1 seq 256, not" in err
        assert "`freqopt transfer --table" in err


@pytest.mark.slow
def test_train_takes_the_sizes_and_layout_it_is_not_given_from_the_table(table, tmp_path):
    from freqopt.errors import TableWorkloadError
    from freqopt.workload.layout import Layout
    from freqopt.apply.train import plan_training

    data = json.loads(json.dumps(table.data))
    data["workload"]["layout"] = {"dp": 2, "tp": 1}  # as a table transferred to two data-parallel ranks
    path = tmp_path / "dp2.json"
    path.write_text(json.dumps(data))
    plan = plan_training("gpt3-small", table=str(path))
    w = plan.workload
    assert (w.layout, w.micro_batch_size, w.config.seq_len) == (Layout(dp=2, tp=1), 1, 256) and plan.needs_launcher
    assert plan_training("gpt3-small", table=str(path), layout="dp=2", micro_batch_size=1).workload == w
    with pytest.raises(TableWorkloadError, match="dp=2,tp=1 micro-batch 1 seq 256, not gpt3-small dp=1,tp=1"):
        plan_training("gpt3-small", table=str(path), layout="dp=1")


# -- file names: one table per search ----------------------------------------------------------------------------
TINY_SEARCH = {"granularity": "iteration", "n_trials": 3, "seq_len": 64, "micro_batch_size": 1}


@pytest.mark.slow
def test_searches_at_two_budgets_in_one_folder_keep_both_tables(tmp_path):
    import freqopt

    one = freqopt.search("gpt3-small", max_slowdown="1%", out=tmp_path, **TINY_SEARCH)
    two = freqopt.search("gpt3-small", max_slowdown="2%", out=tmp_path, **TINY_SEARCH)
    assert one.table_paths["iteration"] == tmp_path / "gpt3-small-h100-sxm-1pct-iteration.json"
    assert two.table_paths["iteration"] == tmp_path / "gpt3-small-h100-sxm-2pct-iteration.json"
    assert load_table(one.table_paths["iteration"]).data["max_slowdown"] == 0.01
    assert load_table(two.table_paths["iteration"]).data["max_slowdown"] == 0.02
    seeded = freqopt.search("gpt3-small", max_slowdown="1%", out=tmp_path, seed=3, **TINY_SEARCH)
    assert seeded.table_paths["iteration"] == tmp_path / "gpt3-small-h100-sxm-1pct-seed3-iteration.json"
    assert len(list(tmp_path.glob("*-iteration.json"))) == 3
    # The same search again (resumed, or re-run) replaces its own table.
    again = freqopt.search("gpt3-small", max_slowdown="1%", out=tmp_path, **TINY_SEARCH)
    assert again.table_paths == one.table_paths


@pytest.mark.slow
def test_a_search_never_replaces_another_searchs_table(tmp_path):
    """Another micro-batch, under the same name: refused before any measurement, the table left as it was."""
    import freqopt

    first = freqopt.search("gpt3-small", max_slowdown="1%", out=tmp_path, **TINY_SEARCH)
    path = first.table_paths["iteration"]
    before = path.read_bytes()
    started = []
    with pytest.raises(OutputError, match=rf"{path} holds the table of another search \(gpt3-small dp=1,tp=1 "
                                          r"micro-batch 1 seq 64 .*, not gpt3-small dp=1,tp=1 micro-batch 2 seq 64"):
        freqopt.search("gpt3-small", max_slowdown="1%", out=tmp_path, on_start=started.append,
                       **{**TINY_SEARCH, "micro_batch_size": 2})  # fmt: skip
    assert started == [] and path.read_bytes() == before
    (tmp_path / "gpt3-small-h100-sxm-2pct-iteration.json").write_text("my notes")  # not a table: not replaced
    with pytest.raises(OutputError, match="exists and is not a freqopt clock table"):
        freqopt.search("gpt3-small", max_slowdown="2%", out=tmp_path, **TINY_SEARCH)
