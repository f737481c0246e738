"""A user's first hour (issue 51, item 1): the `freqopt train` command a search suggests runs as printed and
finishes where it was suggested (small steps and --compare on the simulated GPU), training talks while it runs
(each set-up stage and each step on stderr, and a line at least every 10 s where no bar is drawn), and small steps
give the full step's simulated figures."""

from __future__ import annotations

import io
import re
import shlex
import time

import pytest

from freqopt.cli import main
from freqopt.errors import InvalidSettingError

def _suggested(stderr: str, prefix: str) -> list[str]:
    """The command a search printed after ``prefix``, split as a shell would."""
    lines = [line for line in stderr.splitlines() if prefix in line]
    assert len(lines) == 1, stderr
    return shlex.split(lines[0].split(prefix, 1)[1])


@pytest.mark.slow
def test_the_training_a_search_suggests_runs_as_printed(iteration_search_cli, tmp_path, monkeypatch, capsys):
    """The suggestion of a search at 2 x 64 tokens (conftest's ITERATION_SEARCH, run once for the run)."""
    args = _suggested(iteration_search_cli["stderr"], "apply the iteration table (the most saved) to training with: ")
    assert args[:2] == ["freqopt", "train"]
    assert {"--small-step", "--compare"} <= set(args) and "--backend" not in args  # a simulated GPU's suggestion
    assert args[args.index("--micro-batch-size") + 1] == "2" and args[args.index("--seq-len") + 1] == "64"
    monkeypatch.chdir(tmp_path)  # from another folder than the search's: the suggestion holds absolute paths
    started = time.monotonic()
    assert main(args[1:]) == 0
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert "with the table:" in out and "less energy per step" in out  # --compare: the saving, measured
    assert ("small steps: each step ran 1 x 32 tokens on the CPU; its time and energy are the simulated GPU's for the "
            "workload's 2 x 64 tokens") in out  # fmt: skip
    # Progress on stderr: each stage of the set-up, then each of the 8 steps as it was measured.
    assert "tracing one training iteration of gpt3-small" in err and "building gpt3-small on cpu" in err
    assert "training 8 steps of 1 x 32 tokens on cpu" in err
    steps = re.findall(r"^step (\d)/8 \((table|default) clocks\): [\d.]+ s, [\d.]+ J \(ran [\d.]+ s here\)$", err,
                       re.MULTILINE)  # fmt: skip
    assert steps == [(str(i + 1), "table" if (i // 2) % 2 == 0 else "default") for i in range(8)]
    assert took < 300, took  # issue 51: under 5 minutes on a 2-core CPU (27-135 s here, with other jobs beside)


@pytest.mark.slow
def test_a_pipeline_searchs_suggestion_starts_its_ranks_with_small_steps(tmp_path, monkeypatch, capsys):
    """The pipeline search's suggestion (its layout and micro-batches, the table's sizes) parsed and checked by
    `freqopt train` up to starting the ranks (the launcher mocked; tests/test_pipeline_train.py trains one)."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from pipeline_tables import make_table

    from freqopt.cli.suggest import train_command
    from freqopt.tables import write_table

    table = make_table(stages=2, micro_batches=4)[0]
    path = write_table(table, tmp_path / "pp2.json")
    args = shlex.split(train_command("gpt3-small", table_workload(table), path, micro_batches=4))
    assert args[args.index("--layout") + 1] == "dp=1,tp=1,pp=2" and args[args.index("--micro-batches") + 1] == "4"
    assert args[-4:] == ["--steps", "2", "--small-step", "--compare"]  # several ranks on this CPU: two steps
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: launched.append(cmd) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(args[1:]) == 0
    assert len(launched) == 1 and launched[0][launched[0].index("--num_gpus") + 1] == "2"  # one rank per stage
    assert "starting 2 ranks under DeepSpeed's launcher" in capsys.readouterr().err


def table_workload(table):
    """The Workload a table was found for."""
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import get_workload

    w = table.workload
    return get_workload(w["model"], micro_batch_size=w["micro_batch_size"], seq_len=w["seq_len"],
                        layout=Layout(w["layout"]["dp"], w["layout"]["tp"], pp=w["layout"].get("pp", 1)))


def test_a_real_gpus_search_suggests_the_full_step_compared():
    from freqopt.cli.suggest import train_command
    from freqopt.workload.models import get_workload

    workload = get_workload("gpt3-small")
    line = train_command("gpt3-small", workload, "/t/x.json", backend="nvml")
    assert line == ("freqopt train --model gpt3-small --micro-batch-size 4 --seq-len 2048 --table /t/x.json "
                    "--backend nvml --compare")  # fmt: skip
    assert train_command("gpt3-small", workload, "/t/a b.json", backend=None).endswith(
        "--table '/t/a b.json' --small-step --compare")  # quoted for the shell; a backend not known: simulated


@pytest.mark.slow
def test_small_steps_give_the_full_steps_simulated_figures(iteration_search_cli):
    """The runtime follows module hooks, whose order does not depend on the batch: the same requests, and so the
    same simulated time and energy per step, with one short sequence as with the workload's micro-batch (2 x 64
    tokens: conftest's ITERATION_SEARCH's table)."""
    from freqopt.apply.train import plan_training

    table = next(iteration_search_cli["out"].glob("*-iteration.json"))
    reports = {}
    for small in (False, True):
        statuses, steps = [], []
        plan = plan_training("gpt3-small", table=str(table), steps=4, compare=True, seed=3, small_step=small)
        reports[small] = plan.run(on_step=steps.append, on_status=statuses.append)
        assert steps == list(reports[small].steps)  # each step told as it was measured
        assert statuses[0].startswith("tracing one training iteration") and statuses[-1].startswith("training 4 steps")
    full, small = reports[False], reports[True]
    assert [s.with_table for s in small.steps] == [s.with_table for s in full.steps] == [True, False, True, False]
    assert [s.time_s for s in small.steps] == pytest.approx([s.time_s for s in full.steps], rel=1e-9)
    assert [s.energy_j for s in small.steps] == pytest.approx([s.energy_j for s in full.steps], rel=1e-9)
    assert small.switches_per_step == full.switches_per_step
    assert all(s.wall_s > 0 for s in small.steps + full.steps)


def test_small_steps_are_refused_on_a_real_gpu(capsys):
    from freqopt.apply.train_checks import check_training_arguments

    with pytest.raises(InvalidSettingError) as caught:
        check_training_arguments("gpt3-small", backend="nvml", small_step=True)
    assert caught.value.argument == "small_step"
    assert main(["train", "--model", "gpt3-small", "--backend", "nvml", "--small-step"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("freqopt: error: --small-step applies to the simulated backend, whose step figures come from the "
                   "trace; on 'nvml' the step measured is the step run")  # fmt: skip


def test_no_stretch_of_a_run_is_silent_where_no_bar_is_drawn():
    """Off a terminal (a log, a pipe) a line says what the run is still doing after every heartbeat without one."""
    from rich.console import Console

    from freqopt.cli.train import _TrainProgress

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, width=200)
    with _TrainProgress(console, 2, heartbeat_s=0.3) as progress:
        progress.status("building gpt3-small on cpu")
        time.sleep(1.6)  # a long stage: the heartbeat checks every second
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "building gpt3-small on cpu"
    assert len(lines) >= 2 and all(re.fullmatch(r"  \.\.\. building gpt3-small on cpu \(\d+ s\)", x) for x in lines[1:])
    quiet = io.StringIO()
    with _TrainProgress(Console(file=quiet, force_terminal=False), 2, quiet=True, heartbeat_s=0.1) as progress:
        progress.status("building")  # another rank than 0: nothing
        time.sleep(0.3)
    assert quiet.getvalue() == ""
