import json
import os
import stat

import pytest

from freqopt.backends.simulated import SimulatedGPU
from freqopt.errors import ClockTableError, OutputError
from freqopt.gpus import get_gpu
from freqopt.search import SearchConfig, run_search
from freqopt.tables import SCHEMA_VERSION, load_table, table_from_result, write_table, write_table_csv


@pytest.fixture(scope="module")
def table(small_trace):
    spec = get_gpu("h100-sxm")
    config = SearchConfig(max_slowdown=0.02, granularities=("pass",), n_trials_1d=6)
    result = run_search(small_trace, SimulatedGPU(spec, seed=0), config)
    return table_from_result(result, "pass", spec, backend="sim", seed=0)


def test_round_trip(table, tmp_path):
    path = write_table(table, tmp_path / "t.json")
    loaded = load_table(path, spec=get_gpu("h100-sxm"))
    assert loaded.data == json.loads(json.dumps(table.data))
    assert {e["unit"] for e in loaded.entries} == {"forward", "backward", "optimizer"}
    assert loaded.data["provenance"]["n_measurements"] > 0
    assert not list(tmp_path.glob(".*tmp")), "no temporary file left behind"
    csv_text = write_table_csv(table, tmp_path / "t.csv").read_text().splitlines()
    assert csv_text[0].startswith("unit,") and len(csv_text) == 4


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


def test_other_schema_version_is_refused(table, tmp_path):
    data = dict(table.data, schema_version=SCHEMA_VERSION + 1)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="schema version"):
        load_table(path)


def test_corrupt_entry_is_refused(table, tmp_path):
    data = json.loads(json.dumps(table.data))
    data["entries"][0]["sm_clock_mhz"] = "fast"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="corrupt"):
        load_table(path)


def test_other_gpu_is_refused(table, tmp_path):
    path = write_table(table, tmp_path / "t.json")
    with pytest.raises(ClockTableError, match="searched on h100-sxm, not a100-sxm4-80gb"):
        load_table(path, spec=get_gpu("a100-sxm4-80gb"))


def test_unsupported_clocks_are_refused(table, tmp_path):
    data = json.loads(json.dumps(table.data))
    data["entries"][0]["sm_clock_mhz"] = 1234
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="does not support"):
        load_table(path, spec=get_gpu("h100-sxm"))


def test_missing_file_and_unwritable_target(table, tmp_path):
    with pytest.raises(ClockTableError, match="cannot read"):
        load_table(tmp_path / "nope.json")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError):
        write_table(table, blocker / "t.json")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_honour_the_umask(tmp_path, umask, mode):
    from freqopt.tables import atomic_write_text

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

    from freqopt import tables

    if not proc_readable:  # not Linux: the set-and-put-back fallback
        real_open = builtins.open

        def no_proc(path, *args, **kwargs):
            if str(path) == "/proc/self/status":
                raise OSError("no /proc here")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", no_proc)
    old = os.umask(0o027)
    try:
        assert tables._umask() == 0o027
        assert os.umask(0o027) == 0o027  # still the caller's
    finally:
        os.umask(old)
