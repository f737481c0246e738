"""freqopt.measure.profile and `freqopt profile`: the simulated iteration by kernel kind, and a real training step measured
read-only through the stand-in NVML (tests/fake_pynvml.py) on the CPU, compared with the trace and torch.profiler."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.cli import main
from freqopt.errors import InvalidSettingError
from freqopt.gpu.specs import get_gpu
from freqopt.workload.layout import parse_layout
from freqopt.workload.models import Workload, build_model, get_workload
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.measure.profile import check_device, estimate_step_memory, profile
from freqopt.workload.trace import trace_training_iteration

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU, FakeNVML  # noqa: E402

TINY = {"n_layers": 1, "d_model": 64, "n_heads": 4, "vocab_size": 256, "seq_len": 16}


def test_sim_profile_breaks_the_iteration_down_by_kind(small_trace):
    r = profile(small_trace.workload, SimulatedGPU(get_gpu("h100-sxm")))  # gpt3-small, 1 x 256 tokens
    assert r.backend == "sim" and r.gpu == "h100-sxm" and r.time_s > 0 and r.energy_j > 0
    # The kinds hold the kernels' busy time and energy; the waiting for the host is apart, and with it they sum.
    assert sum(f.time_s for f in r.by_kind.values()) + r.waiting_s == pytest.approx(r.time_s, rel=1e-9)
    assert sum(f.energy_j for f in r.by_kind.values()) + r.waiting_energy_j == pytest.approx(r.energy_j, rel=1e-9)
    assert r.kernel_time_s == pytest.approx(sum(f.time_s for f in r.by_kind.values()), rel=1e-9)
    assert sum(f.n_kernels for f in r.by_kind.values()) == len(small_trace)
    for kind, f in r.by_kind.items():
        mine = [k for k in small_trace.kernels if k.kind == kind]
        assert (f.flops, f.mem_bytes) == (sum(k.flops for k in mine), sum(k.mem_bytes for k in mine))
        assert f.bandwidth_tb_s == pytest.approx(f.mem_bytes / f.time_s / 1e12)
    assert r.flops == small_trace.total_flops
    assert {"gemm", "attention", "optimizer"} <= set(r.by_kind)
    assert r.avg_power_w == pytest.approx(r.energy_j / r.time_s)
    doc = r.summary()
    assert doc["avg_power_w"] == pytest.approx(r.energy_j / r.time_s)
    assert "measured" not in doc and "profiler_by_kind" not in doc  # nvml only


@pytest.mark.slow
def test_cli_profile_writes_the_json_document(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "gpt3-small", "--seq-len", "256", "--micro-batch-size", "1",
                 "--json", str(out)]) == 0  # fmt: skip
    assert "gemm" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert {"time_s", "energy_j", "avg_power_w", "flops", "by_kind"} <= set(doc)
    assert all(set(v) == {"time_s", "energy_j", "n_kernels", "flops", "mem_bytes", "bandwidth_tb_s", "tflop_s"}
               for v in doc["by_kind"].values())  # fmt: skip
    assert doc["setting"] == {"sm_clock_mhz": None, "mem_clock_mhz": None, "power_limit_w": None}  # the defaults
    assert list(doc["by_pass"]) == ["forward", "backward", "optimizer"]
    assert all(set(v) == {"time_s", "energy_j", "waiting_s", "waiting_energy_j"} for v in doc["by_pass"].values())
    trace = trace_training_iteration(get_workload("gpt3-small", seq_len=256, micro_batch_size=1))
    assert doc["flops"] == trace.total_flops
    assert not [p for p in tmp_path.iterdir() if p.name != "p.json"]  # written atomically: no temporary left
    memory = doc["memory"]
    assert set(memory) == {"weights_gb", "gradients_gb", "optimizer_gb", "activations_gb", "total_gb", "gpu_gb",
                           "dtype"}  # fmt: skip
    assert memory["gpu_gb"] == 80 and memory["dtype"] == "bfloat16"
    assert memory["weights_gb"] == pytest.approx(2 * trace.meta["n_params"] / 1e9)  # BF16
    assert memory["total_gb"] == pytest.approx(sum(memory[k] for k in ("weights_gb", "gradients_gb", "optimizer_gb",
                                                                       "activations_gb")))  # fmt: skip


def test_cli_profile_shows_the_memory_estimate(capsys):
    assert main(["profile", "--model", "gpt3-small", "--seq-len", "128", "--micro-batch-size", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per rank"))
    assert "(estimated, bfloat16):" in line and "optimizer state" in line and line.endswith("of the GPU's 80 GB")


def test_cli_profile_of_a_step_too_large_warns_in_one_line_and_reports(capsys):
    assert main(["profile", "--model", "gpt3-small", "--seq-len", "128", "--micro-batch-size", "20000"]) == 0
    captured = capsys.readouterr()
    [warning] = captured.err.strip().splitlines()
    assert warning.startswith("freqopt: warning: gpt3-small (micro_batch_size 20000, seq_len 128, dp=1,tp=1) needs")
    assert "profiled anyway" in warning and "one training iteration on h100-sxm" in captured.out


def test_step_memory_counts_model_states_as_the_step_holds_them():
    """BF16: 2 + 2 + 12 bytes per parameter (FP32 master weights and two moments: Rajbhandari et al. 2020); FP32
    (training on a CPU): 4 + 4 + 8, the master weights being the parameters themselves. Plus a 4-byte step count
    per parameter tensor. Tensor parallelism shards them; data parallelism (ZeRO stage 0) does not."""
    workload = Workload("tiny", GPTConfig(**TINY), 2)
    model = build_model(workload.config)
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    bf16, fp32 = estimate_step_memory(workload), estimate_step_memory(workload, dtype=torch.float32)
    assert (bf16.n_params, bf16.weights_bytes, bf16.gradients_bytes, bf16.optimizer_bytes) == (
        n, 2 * n, 2 * n, 12 * n + 4 * tensors)
    assert (fp32.weights_bytes, fp32.gradients_bytes, fp32.optimizer_bytes) == (4 * n, 4 * n, 8 * n + 4 * tensors)
    assert fp32.activations_bytes == pytest.approx(2 * bf16.activations_bytes, rel=0.2)  # FP32 lse in both
    assert bf16.total_bytes == bf16.weights_bytes + bf16.gradients_bytes + bf16.optimizer_bytes + bf16.activations_bytes
    small = get_workload("gpt3-small", seq_len=256, micro_batch_size=2)
    one = estimate_step_memory(small)
    tp2 = estimate_step_memory(get_workload("gpt3-small", seq_len=256, micro_batch_size=2, layout=parse_layout("tp=2")))
    dp2 = estimate_step_memory(get_workload("gpt3-small", seq_len=256, micro_batch_size=2, layout=parse_layout("dp=2")))
    assert dp2 == one and tp2.weights_bytes < 0.75 * one.weights_bytes and tp2.activations_bytes < one.activations_bytes
    double = estimate_step_memory(get_workload("gpt3-small", seq_len=256, micro_batch_size=4))
    assert double.activations_bytes == pytest.approx(2 * one.activations_bytes, rel=0.01)


def test_activations_are_what_a_real_forward_pass_keeps_for_backward():
    """The estimate, made on the meta device, against a real forward pass on the CPU: what torch.profiler's memory
    profile shows allocated during the forward pass and not freed by its end (the saved tensors and the loss)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from freqopt.apply.train import synthetic_batch

    workload = Workload("tiny", GPTConfig(**TINY), 3)
    estimate = estimate_step_memory(workload, dtype=torch.float32)
    model = build_model(workload.config, device="cpu", dtype=torch.float32)
    idx, targets = synthetic_batch(workload, torch.Generator().manual_seed(0), "cpu")
    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(idx, targets)
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    assert kept - loss.element_size() == pytest.approx(estimate.activations_bytes, rel=0.01)


def test_every_gpu_type_states_its_memory():
    from freqopt.gpu.specs import list_gpus

    memory = {name: get_gpu(name).memory_gb for name in list_gpus()}
    assert all(gb is not None and gb > 0 for gb in memory.values())
    assert (memory["h100-sxm"], memory["h200-sxm"], memory["rtx3080ti"], memory["v100-pcie"]) == (80, 141, 12, 16)


@pytest.mark.slow
def test_profile_warns_of_a_simulated_step_that_does_not_fit_the_gpu_and_skips_a_gpu_of_unknown_memory():
    from freqopt.workload.memory import GPUMemoryWarning

    with pytest.warns(GPUMemoryWarning, match=r"gpt3-175b \(micro_batch_size 1, seq_len 2048, dp=1,tp=8\) needs "
                                              r"about [\d,]+ GB .* more than one a100-sxm4-80gb's 80 GB; spread the "
                                              r"model over more GPUs.*; profiled anyway"):  # fmt: skip
        r = profile("gpt3-175b", gpu="a100-sxm4-80gb", layout="tp=8", micro_batch_size=1, sm_clock_mhz=1200)
    assert r.memory.total_bytes > 80e9 and r.time_s > 0 and r.setting.sm_clock_mhz == 1200
    unknown = dataclasses.replace(get_gpu("h100-sxm"), memory_gb=None)
    r = profile(get_workload("gpt3-small", seq_len=64, micro_batch_size=1), SimulatedGPU(unknown))
    assert r.gpu_memory_gb is None and r.summary()["memory"]["gpu_gb"] is None and r.memory.total_bytes > 0


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt4"], "unknown model"),
    (["--model", "gpt3-small", "--json", "/no/such/dir/p.json"], "--json /no/such/dir/p.json: cannot write there"),
    (["--model", "gpt3-small", "--backend", "tpu"], "unknown backend"),
    (["--model", "gpt3-small", "--steps", "0"], "steps must be a positive integer"),
    (["--model", "gpt3-small", "--device", "cpu"], "device applies to backend nvml"),
    (["--model", "gpt3-small", "--sm-clock", "1201"],
     "h100-sxm does not support SM 1201 MHz with memory 2619 MHz; SM clocks are 345-1980 MHz"),
    (["--model", "gpt3-small", "--sm-clock", "1200", "--mem-clock", "1000"],
     "does not support SM 1200 MHz with memory 1000 MHz; SM clocks are 345-1980 MHz (110 values), memory clocks"),
    (["--model", "gpt3-small", "--power-limit", "10"], "h100-sxm accepts power limits 200-700 W, not 10 W"),
    (["--model", "gpt3-small", "--gpu", "v100-pcie", "--sm-clock", "1980"], "v100-pcie does not support SM 1980 MHz"),
])  # fmt: skip
def test_cli_profile_bad_input_is_one_line_exit_2(args, message, capsys):
    assert main(["profile", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("freqopt: error:") and message in err


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_cuda_device_on_a_cpu_only_torch_says_what_to_do():
    with pytest.raises(InvalidSettingError, match="CPU build; install a CUDA build of torch.*device 'cpu'"):
        check_device("cuda")
    assert check_device("cpu") == "cpu"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    nvml = FakeNVML(gpus=[FakeGPU(realtime=True, counter_period_s=0.01)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared CPU: several threads only wait for each other
    yield nvml
    torch.set_num_threads(threads)


@pytest.mark.parametrize("read_only", [True, False])
def test_nvml_profile_measures_a_real_step_beside_the_prediction_and_sets_nothing(fake, read_only):
    from freqopt.gpu.backends import get_backend

    fake.root = True  # even where changes would be allowed
    workload = Workload("tiny", GPTConfig(**TINY), 2)
    backend = get_backend("nvml", None, read_only=read_only)
    # A writable backend checks its permission when opened and restores the GPU when closed; profile sets nothing.
    calls_before = len(fake.set_calls())
    try:
        r = profile(workload, backend, device="cpu", steps=3, warmup_steps=1)
        assert fake.set_calls()[calls_before:] == []
    finally:
        backend.close()
    assert not read_only or fake.set_calls() == []
    assert r.backend == "nvml" and r.device == "cpu"
    assert r.time_s > 0 and r.energy_j > 0 and r.predicted.time_s > 0 and r.predicted.energy_j > 0
    assert r.avg_power_w == pytest.approx(400.0, rel=0.25)  # the stand-in board draws 400 W
    assert r.window_s >= 1.0 and r.window_s >= 5 * r.counter_period_s and r.n_steps >= 3
    trace = trace_training_iteration(workload, dtype=torch.float32)
    gemm = r.profiler_by_kind["gemm"]
    assert gemm.profiled_n_kernels == gemm.traced_n_kernels == sum(k.kind == "gemm" for k in trace.kernels)
    assert gemm.measured_time_s > 0 and gemm.predicted_time_s > 0
    doc = r.summary()
    assert {"measured", "predicted", "measured_over_predicted", "profiler_by_kind"} <= set(doc)
    assert doc["setting"] is None  # the GPU's current settings, only read
    assert sum(f["time_s"] + f["waiting_s"] for f in doc["by_pass"].values()) == pytest.approx(r.predicted.time_s,
                                                                                               rel=1e-9)  # fmt: skip
    assert doc["predicted"]["waiting_s"] == pytest.approx(sum(f["waiting_s"] for f in doc["by_pass"].values()))
    assert doc["measured_over_predicted"]["energy"] == pytest.approx(r.energy_j / r.predicted.energy_j)


def test_nvml_profile_refuses_a_layout_of_several_gpus(fake):
    from freqopt.gpu.backends import get_backend
    from freqopt.workload.layout import parse_layout

    workload = get_workload("gpt3-small", seq_len=16, micro_batch_size=1, layout=parse_layout("dp=2"))
    with get_backend("nvml", None, read_only=True) as backend:
        with pytest.raises(InvalidSettingError, match="single-GPU layout"):
            profile(workload, backend, device="cpu")
    assert fake.set_calls() == []


def test_cli_profile_on_nvml_is_read_only(fake, tmp_path, capsys, monkeypatch):
    from freqopt.workload import models
    monkeypatch.setitem(models.MODELS, "tiny-gpt", GPTConfig(**TINY))
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny-gpt", "--backend", "nvml", "--device", "cpu", "--micro-batch-size", "2",
                 "--steps", "2", "--json", str(out)]) == 0  # fmt: skip
    assert "trace against torch.profiler" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["backend"] == "nvml" and doc["measured"]["energy_j"] > 0 and doc["predicted"]["energy_j"] > 0
    row = doc["profiler_by_kind"]["gemm"]
    assert row["profiled_n_kernels"] == row["traced_n_kernels"] > 0
    assert fake.set_calls() == []  # not even the permission check of a writable backend
    assert doc["memory"]["dtype"] == "float32" and doc["memory"]["activations_gb"] > 0  # as it trains on the CPU


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"micro_batch_size": 1, "seq_len": 128}, {}], ids=["mb1-seq128", "defaults"])
def test_the_searchs_default_row_is_the_step_profile_prints(sizes):
    """One physics (issue 22, item 4): the search's baseline (three noisy readings of the whole step at the GPU's
    defaults) and ``freqopt profile`` measure the same step, host gaps included: within 0.5 %. Before, the search
    replayed the step back to back (no host gaps) and printed 7.91 ms against profile's 9.09 ms at mb1/seq128."""
    from freqopt.search import SearchConfig, run_search

    report = profile("gpt3-small", "sim", **sizes)
    trace = trace_training_iteration(get_workload("gpt3-small", **sizes))
    config = SearchConfig(max_slowdown=0.01, granularities=("iteration",), n_trials_1d=3)
    baseline = run_search(trace, SimulatedGPU(get_gpu("h100-sxm")), config).baseline
    assert baseline.time_s == pytest.approx(report.time_s, rel=0.005)
    assert baseline.energy_j == pytest.approx(report.energy_j, rel=0.005)


# gpt3-small at 16384 tokens a step: GEMMs take most of the step's time, and the GPU, not the host, sets it (at
# 2048 tokens the measured H100 step waits for the host: experiments/h100_whole_steps.md)
COMPUTE_BOUND = {"micro_batch_size": 8, "seq_len": 2048}


@pytest.mark.slow
@pytest.mark.parametrize("setting", [ClockSetting(1200), ClockSetting(900, 1593), ClockSetting(power_limit_w=250),
                                     ClockSetting(1500, None, 300)], ids=lambda s: s.label())  # fmt: skip
def test_profile_at_a_setting_is_the_whole_step_validation_measures_there(setting, tmp_path):
    """One physics (issue 23, item 1): ``freqopt profile --sm-clock X`` is the whole step that the search's
    validation measures for the one setting X on every kernel (``SimulatedGPU.step``, noiseless, and
    ``measure_schedule`` with switching, as validate.py calls it), to the last bit."""
    workload = get_workload("gpt3-small", **COMPUTE_BOUND)
    kernels = trace_training_iteration(workload).kernels
    gpu = SimulatedGPU(get_gpu("h100-sxm"), noise=False)
    step = gpu.step(kernels, [setting] * len(kernels))
    validated = gpu.measure_schedule(kernels, [setting] * len(kernels), switching=True)
    r = profile(workload, "sim", sm_clock_mhz=setting.sm_clock_mhz, mem_clock_mhz=setting.mem_clock_mhz,
                power_limit_w=setting.power_limit_w)  # fmt: skip
    assert (r.time_s, r.energy_j) == (step.time_s, step.energy_j) == (validated.time_s, validated.energy_j)
    assert r.setting == setting
    out = tmp_path / "p.json"
    flags = [f for flag, v in (("--sm-clock", setting.sm_clock_mhz), ("--mem-clock", setting.mem_clock_mhz),
                               ("--power-limit", setting.power_limit_w)) if v is not None for f in (flag, str(v))]  # fmt: skip
    assert main(["profile", "--model", "gpt3-small", "--micro-batch-size", str(COMPUTE_BOUND["micro_batch_size"]),
                 "--seq-len", str(COMPUTE_BOUND["seq_len"]), *flags, "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert (doc["time_s"], doc["energy_j"]) == (step.time_s, step.energy_j)
    assert doc["setting"] == dataclasses.asdict(setting)


@pytest.mark.slow
def test_the_setting_moves_the_step_as_the_physics_says():
    """A compute-bound step: a lower SM clock makes the GEMMs and the step slower and the step cheaper; a lower
    memory clock slows the memory-bound kernels (elementwise, optimizer) and not the GEMMs much; a power limit
    below the step's default draw holds its average power to the limit and slows it."""
    default = profile("gpt3-small", **COMPUTE_BOUND)
    slow_sm = profile("gpt3-small", sm_clock_mhz=900, **COMPUTE_BOUND)
    slow_mem = profile("gpt3-small", mem_clock_mhz=1593, **COMPUTE_BOUND)
    capped = profile("gpt3-small", power_limit_w=250, **COMPUTE_BOUND)
    assert default.by_kind["gemm"].time_s > 0.3 * default.time_s  # compute-bound
    assert slow_sm.time_s > 1.1 * default.time_s and slow_sm.energy_j < 0.8 * default.energy_j
    assert slow_sm.by_kind["gemm"].time_s > 1.3 * default.by_kind["gemm"].time_s
    for kind in ("elementwise", "optimizer"):
        assert slow_mem.by_kind[kind].time_s > 1.2 * default.by_kind[kind].time_s
    assert slow_mem.by_kind["gemm"].time_s < 1.1 * default.by_kind["gemm"].time_s
    assert default.avg_power_w > 300 and capped.avg_power_w <= 250 * (1 + 1e-9) and capped.time_s > default.time_s
    assert slow_sm.summary()["setting"] == {"sm_clock_mhz": 900, "mem_clock_mhz": None, "power_limit_w": None}


def test_by_pass_sums_to_the_step_and_collectives_count_in_their_pass():
    """forward, backward, optimizer in issue order, summing to the step; under data parallelism the gradients'
    all-reduces are issued in backward and the gradient norm's in the optimizer, and count there."""
    workload = get_workload("gpt3-small", micro_batch_size=1, seq_len=256, layout=parse_layout("dp=2,tp=2"))
    r = profile(workload, "sim", sm_clock_mhz=1410)
    assert list(r.by_pass) == ["forward", "backward", "optimizer"]
    assert sum(f.time_s + f.waiting_s for f in r.by_pass.values()) == pytest.approx(r.time_s, rel=1e-12)
    assert sum(f.energy_j + f.waiting_energy_j for f in r.by_pass.values()) == pytest.approx(r.energy_j, rel=1e-12)
    assert sum(f.waiting_s for f in r.by_pass.values()) == pytest.approx(r.waiting_s, rel=1e-12)
    kernels = trace_training_iteration(workload).kernels
    time_s, energy_j, _ = SimulatedGPU(get_gpu("h100-sxm")).run(kernels, [ClockSetting(1410)] * len(kernels),
                                                                 loop=False)  # fmt: skip
    collectives = {k.pass_name for k in kernels if k.is_collective}
    assert collectives == {"forward", "backward", "optimizer"}  # tp in every pass, dp's buckets in backward
    for name, f in r.by_pass.items():
        mine = [i for i, k in enumerate(kernels) if k.pass_name == name]
        assert (f.time_s + f.waiting_s, f.energy_j + f.waiting_energy_j) == pytest.approx(
            (time_s[mine].sum(), energy_j[mine].sum()), rel=1e-12)
    assert r.summary()["by_pass"]["optimizer"] == dataclasses.asdict(r.by_pass["optimizer"])


@pytest.mark.parametrize("argument,flag,value", [("sm_clock_mhz", "--sm-clock", 1200),
                                                  ("mem_clock_mhz", "--mem-clock", 1593),
                                                  ("power_limit_w", "--power-limit", 300)])  # fmt: skip
def test_nvml_profile_refuses_a_setting_and_touches_nothing(fake, capsys, monkeypatch, argument, flag, value):
    """profile only reads a real GPU: a setting is refused before the GPU is opened, naming the argument (the
    library) or the flag (the command line), in one line with exit status 2."""
    from freqopt.workload import models
    workload = Workload("tiny", GPTConfig(**TINY), 2)
    with pytest.raises(InvalidSettingError, match=rf"^{argument} applies to the simulated GPU; on nvml profile only "
                                                  "reads the GPU") as info:  # fmt: skip
        profile(workload, "nvml", device="cpu", **{argument: value})
    assert info.value.argument == argument
    monkeypatch.setitem(models.MODELS, "tiny-gpt", GPTConfig(**TINY))
    assert main(["profile", "--model", "tiny-gpt", "--backend", "nvml", "--device", "cpu", flag, str(value)]) == 2
    captured = capsys.readouterr()
    expected = (f"freqopt: error: {flag} applies to the simulated GPU; on nvml profile only reads the GPU at its "
                "current settings and never sets one")  # fmt: skip
    assert captured.out == "" and captured.err.splitlines() == [expected]
    assert fake.calls == []  # refused before the GPU is even opened


# SmolLM2-135M's architecture (tests/data/hf/smollm2-135m/config.json, the published config's sizes): 30 thin layers
# whose many small kernels the host issues more slowly than the GPU runs them (issue 51, item 2).
SMOLLM2 = Path(__file__).parent / "data" / "hf" / "smollm2-135m"


@pytest.mark.slow
def test_a_host_bound_step_names_its_waiting_and_keeps_it_out_of_the_kernels(capsys, tmp_path):
    """Issue 51, item 2: a host-bound step (SmolLM2-135M's config, 1 x 64 tokens) showed its waiting for the host as
    slow elementwise kernels. The kinds now hold busy time only (their bandwidth on it), the waiting is its own
    figure with its share and energy, and the command line names it in one line and one table row."""
    pytest.importorskip("transformers")
    model = f"hf:{SMOLLM2}"
    r = profile(model, "sim", micro_batch_size=1, seq_len=64)
    assert r.host_bound and r.waiting_share > 0.5 and r.summary()["host_bound"] is True
    kernels = trace_training_iteration(get_workload(model, micro_batch_size=1, seq_len=64)).kernels
    gpu = SimulatedGPU(get_gpu("h100-sxm"), noise=False)
    time_s, _, _ = gpu.run(kernels, [ClockSetting()] * len(kernels), loop=False)
    with_waiting = time_s[[k.kind == "elementwise" for k in kernels]].sum()
    assert r.by_kind["elementwise"].time_s < 0.5 * with_waiting  # most of its wall time was the host's
    assert r.waiting_s == pytest.approx(gpu.waiting(kernels).time_s, rel=1e-12)
    assert 0 < r.waiting_energy_j < r.energy_j and r.kernel_energy_j == pytest.approx(r.energy_j - r.waiting_energy_j)
    assert r.waiting_line().startswith(f"the GPU waits for the host {100 * r.waiting_share:.0f} % of the step "
                                       f"({1e3 * r.waiting_s:.2f} ms of {1e3 * r.time_s:.2f} ms")  # fmt: skip
    assert "host-bound" in r.waiting_line()
    text = str(r)
    assert text.splitlines()[1] == r.waiting_line() and "elementwise" in text and "TB/s" in text
    assert repr(r).startswith("ProfileReport(model='hf:smollm2-135m', gpu='h100-sxm', backend='sim'")
    assert "\n" not in repr(r) and len(repr(r)) < 200
    assert main(["profile", "--model", model, "--micro-batch-size", "1", "--seq-len", "64"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"the GPU waits for the host {100 * r.waiting_share:.0f} % of the step" in out
    assert "waiting for the host" in out and "host-bound" in out


def test_a_gpu_bound_step_is_not_called_host_bound():
    """A compute-bound step (gpt3-small, 8 x 2048 tokens): the waiting is a small share, no host-bound sentence."""
    r = profile("gpt3-small", **COMPUTE_BOUND)
    assert not r.host_bound and r.waiting_share < 0.2 and "host-bound" not in r.waiting_line()
    assert r.by_kind["gemm"].tflop_s > 100  # tensor-core GEMMs on busy time
