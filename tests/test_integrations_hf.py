"""FreqoptCallback: a real (tiny, CPU) transformers Trainer run under the DVFS runtime; the runtime exited and the
GPU restored also when training raises; transformers stays optional."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate: pip install -e '.[test]'")

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting  # noqa: E402
from freqopt.gpu.backends.simulated import SimulatedGPU  # noqa: E402
from freqopt.errors import MissingDependencyError, TraceMismatchError, UnknownNameError  # noqa: E402
from freqopt.gpu.specs import get_gpu  # noqa: E402
from freqopt.integrations.hf import FreqoptCallback, TrainerGPT  # noqa: E402
from freqopt.workload.models import Workload  # noqa: E402
from freqopt.workload.models.gpt3 import GPTConfig  # noqa: E402
from freqopt.tables import ClockTable, workload_doc  # noqa: E402
from freqopt.workload.trace import trace_training_iteration  # noqa: E402

H100 = get_gpu("h100-sxm")
INSTANT = dataclasses.replace(H100, clock_switch_s=0.0)  # an H100 whose clock switches land at once
TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)
SETTINGS = {"forward": 1500, "backward": 1200, "optimizer": 1005}
WORKLOAD = workload_doc(Workload("tiny", TINY, 2))  # the tables' (and the trace's) workload


class Failing(TrainerGPT):
    def __init__(self, config, fail_at_call: int):
        super().__init__(config)
        self.calls, self.fail_at_call = 0, fail_at_call

    def forward(self, input_ids, labels=None):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("data loader broke")
        return super().forward(input_ids, labels)


def pass_table() -> ClockTable:
    entries = [{"unit": p, "sm_clock_mhz": c, "mem_clock_mhz": 2619, "power_limit_w": None}
               for p, c in SETTINGS.items()]  # fmt: skip
    return ClockTable({"granularity": "pass", "entries": entries, "gpu": {"name": "h100-sxm"}, "workload": WORKLOAD})


def dataset(n: int = 8):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (n, TINY.seq_len + 1), generator=g)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def trainer(model, tmp_path, callback, steps=3):
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps,
                                          per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no", learning_rate=1e-3,
                                          disable_tqdm=True)  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[callback])


def tiny_model(cls=TrainerGPT, *args):
    torch.manual_seed(0)
    with torch.device("cpu"):
        return cls(TINY, *args)


@pytest.fixture(scope="module")
def trace():
    return trace_training_iteration(Workload("tiny", TINY, 2))  # WORKLOAD


@pytest.mark.slow
def test_trainer_runs_under_the_runtime_on_the_simulated_gpu(tmp_path, trace):
    model = tiny_model()
    callback = FreqoptCallback(pass_table(), trace, backend=SimulatedGPU(INSTANT, noise=False))
    seen = []
    original = callback.on_pre_optimizer_step

    def spy(*args, **kwargs):
        seen.append(callback.runtime.plan.labels[callback.runtime._position])  # the phase before the mark
        return original(*args, **kwargs)

    callback.on_pre_optimizer_step = spy
    result = trainer(model, tmp_path, callback).train()
    steps = 3
    assert result.global_step == steps
    labels = trace.meta["marks"]
    last_backward = [label for label, _ in labels][[label for label, _ in labels].index("step") - 1]
    assert seen == [last_backward] * steps  # each optimizer mark comes after the whole backward
    # Phases followed: per step into forward, backward and the optimizer (the table's three clocks).
    assert len(callback.step_measurements) == steps
    default = SimulatedGPU(INSTANT, noise=False).measure_schedule(trace.kernels, [DEFAULT_SETTING] * len(trace))
    assert all(m.energy_j < default.energy_j for m in callback.step_measurements)
    assert callback.runtime is None  # on_train_end exited it
    assert not any(m._forward_pre_hooks or m._backward_pre_hooks for m in model.modules())


@pytest.mark.slow
def test_switch_counts_and_settings_through_trainer(tmp_path, trace):
    model = tiny_model()
    callback = FreqoptCallback(pass_table(), trace, backend=SimulatedGPU(INSTANT, noise=False))
    runtimes = []
    begin = callback.on_train_begin

    def keep(*args, **kwargs):
        begin(*args, **kwargs)
        runtimes.append(callback.runtime)

    callback.on_train_begin = keep
    trainer(model, tmp_path, callback, steps=2).train()
    (runtime,) = runtimes
    assert set(runtime.plan.settings) == {ClockSetting(c, 2619) for c in SETTINGS.values()}
    assert runtime.switches == 3 * 2


def test_auto_backend_on_the_cpu_is_the_simulated_gpu_of_the_tables_type(tmp_path, trace):
    callback = FreqoptCallback(pass_table(), trace)
    trainer(tiny_model(), tmp_path, callback, steps=1).train()
    assert len(callback.step_measurements) == 1  # measured on the simulated H100 of the table


def test_a_trace_of_another_model_is_refused_when_training_begins(tmp_path):
    other = trace_training_iteration(Workload("wider", dataclasses.replace(TINY, d_model=128), 2))
    callback = FreqoptCallback(pass_table(), other, backend="sim")
    with pytest.raises(TraceMismatchError, match="trace the model you train"):
        trainer(tiny_model(), tmp_path, callback, steps=1).train()


def test_bad_backend_name_is_one_line(trace):
    with pytest.raises(UnknownNameError, match="unknown backend 'tpu'; choose one of auto, sim, nvml"):
        FreqoptCallback(pass_table(), trace, backend="tpu")


def test_with_block_exits_the_runtime_when_training_raises(tmp_path, trace):
    model = tiny_model(Failing, 3)
    sim = SimulatedGPU(INSTANT, noise=False)
    closed = []
    sim.close = lambda: closed.append(True)
    with pytest.raises(RuntimeError, match="data loader broke"):
        with FreqoptCallback(pass_table(), trace, backend=sim) as callback:
            trainer(model, tmp_path, callback).train()
    assert callback.runtime is None and closed == [True]
    assert not any(m._forward_pre_hooks or m._backward_pre_hooks for m in model.modules())


def test_gpu_restored_when_training_raises_on_the_nvml_backend(fake_gpu, tmp_path, trace):
    """Through a stand-in NVML: the table's clocks are locked while Trainer trains, and the failure inside the
    ``with callback:`` block restores the GPU."""
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    table = ClockTable({"granularity": "iteration", "gpu": {"name": "h100-sxm"}, "workload": WORKLOAD,
                        "entries": [{"unit": "iteration", "sm_clock_mhz": 1005, "mem_clock_mhz": 2619,
                                     "power_limit_w": None}]})  # fmt: skip
    backend = NVMLBackend(open_devices()[0], torch_device="cpu")
    with pytest.raises(RuntimeError, match="data loader broke"):
        with FreqoptCallback(table, trace, backend=backend) as callback:
            trainer(tiny_model(Failing, 3), tmp_path, callback).train()
    locks = [c[2] for c in fake_gpu.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    assert locks == [1005]  # locked once, before the first step
    gpu = fake_gpu.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.power_limit_mw) == (None, 650_000)
    assert not list((tmp_path / "state").glob("*.json"))


def test_freqopt_does_not_import_transformers_and_the_integration_says_how_to_install_it():
    script = textwrap.dedent("""
        import sys
        import freqopt, freqopt.apply.runtime, freqopt.integrations, freqopt.workload.fingerprint
        assert 'transformers' not in sys.modules, 'transformers imported'
        sys.modules['transformers'] = None  # as if not installed
        from freqopt.errors import MissingDependencyError
        try:
            import freqopt.integrations.hf
        except MissingDependencyError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("freqopt.integrations.hf needs Hugging Face transformers: pip install "
                                   "'transformers>=4.47' 'accelerate>=1.1' (or pip install -e '.[hf]' in the freqopt "
                                   "checkout)")  # fmt: skip
    assert issubclass(MissingDependencyError, ImportError)
