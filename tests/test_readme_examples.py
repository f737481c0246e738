"""The documentation's "Your training loop" examples (docs/training-loop.md), run as written: each code block after a
``<!-- test: NAME -->`` comment is extracted and executed in one folder, the later blocks continuing the first one's
session (its names, and the table it wrote), as the page says."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from freqopt.gpu.backends.base import DEFAULT_SETTING
from freqopt.workload.phases import HOOK_WARNING

README = Path(__file__).parent.parent / "docs" / "training-loop.md"
BLOCK = re.compile(r"<!-- test: (?P<name>[\w-]+) -->\s*```(?P<lang>\w+)\n(?P<code>.*?)```", re.DOTALL)


def examples() -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["lang"], m["code"]) for m in BLOCK.finditer(README.read_text(encoding="utf-8"))}


def run_python(name: str, folder: Path, namespace: dict) -> list:
    """Run the page's block ``name`` in ``folder`` and ``namespace``; returns the warnings it raised."""
    lang, code = examples()[name]
    assert lang == "python"
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(code, f"docs/training-loop.md:{name}", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return caught


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> tuple[Path, dict]:
    """The first block (trace and search), run in a fresh folder: the others continue its session."""
    folder, namespace = tmp_path_factory.mktemp("readme"), {"__name__": "__main__"}
    run_python("search", folder, namespace)
    assert (folder / "tables" / "my-lm-h100-sxm-1pct-iteration.json").is_file()
    return folder, namespace


def test_search_example_traces_the_users_model_and_meets_the_budget(session):
    """The user's own module (SDPA, RMSNorm, SwiGLU, torch.optim.AdamW) through freqopt.trace_step and
    freqopt.search: attention traced as the fused kernel, all three passes, and a validated table within budget."""
    trace, result = session[1]["trace"], session[1]["result"]
    kinds = {k.kind for k in trace.kernels}
    assert {"gemm", "attention", "optimizer"} <= kinds
    assert not [k for k in trace.kernels if k.name in ("aten._softmax", "aten._safe_softmax", "aten.bmm")]  # no math path
    assert {k.pass_name for k in trace.kernels} == {"forward", "backward", "optimizer"}
    assert sum(k.kind == "attention" for k in trace.kernels) == 4  # 2 layers, forward and backward
    row = result.summary()["results"]["iteration"]
    assert row["slowdown_pct"] <= 1.0 + 0.1  # the budget, within the simulated timing noise
    assert row["energy_saved_pct"] > 0


def test_the_readme_has_the_examples():
    assert {"search", "runtime-loop", "hf-trainer"} <= set(examples())


@pytest.mark.slow
def test_runtime_loop_example(session, capsys):
    folder, namespace = session[0], dict(session[1])
    caught = run_python("runtime-loop", folder, namespace)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2"]
    assert not [w for w in caught if HOOK_WARNING in str(w.message)]  # the runtime kept it out
    runtime, table, trace = namespace["runtime"], namespace["table"], namespace["trace"]
    table_setting = {(e["sm_clock_mhz"], e["mem_clock_mhz"]) for e in table.entries}
    assert {(s.sm_clock_mhz, s.mem_clock_mhz) for s in runtime.plan.settings} <= table_setting
    assert DEFAULT_SETTING not in runtime.plan.settings  # the search found clocks below the default
    # The steps ran with the table's clocks: less energy than the same iteration at the default clocks.
    default = namespace["gpu"].measure_schedule(trace.kernels, [DEFAULT_SETTING] * len(trace), key="readme-default")
    assert runtime.step_measurement().energy_j < default.energy_j


@pytest.mark.slow
def test_hf_trainer_example(session, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate: pip install -e '.[test]'")
    folder, namespace = session[0], dict(session[1])
    caught = run_python("hf-trainer", folder, namespace)
    callback = namespace["callback"]
    assert len(callback.step_measurements) == 3 and callback.runtime is None
    assert capsys.readouterr().out.strip().count(" J") == 3
    assert not [w for w in caught if HOOK_WARNING in str(w.message)]
    assert namespace["trainer"].state.global_step == 3
