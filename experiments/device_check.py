"""Read-only check of freqopt on a lent GPU (H100, H200): NVML discovery, kernels replayed as themselves against
the simulated GPU, the trace against torch.profiler, and whole training steps measured against predicted. Changes
no setting of the GPU.

    python experiments/device_check.py [OUT_DIR]          # with an NVIDIA GPU; OUT_DIR default experiments/device/
    python experiments/device_check.py --dry-run OUT_DIR  # anywhere: CPU, a tiny model, tests/fake_pynvml.py's NVML

Before anything touches the GPU, ``install_guard`` replaces every pynvml function that changes a device or the
system (``nvmlDeviceSet*``, ``nvmlDeviceReset*``, ``nvmlDeviceClear*``, ``nvmlSet*`` and the others of
``GUARDED_PREFIXES``) with one that raises PermissionError; on top, every NVML access goes through a device opened
read-only (freqopt.gpu.nvml.NVMLDevice refuses set and reset calls before NVML sees them). So it is safe on a shared
GPU. It writes OUT_DIR/device_check.json (and prints progress) with:

a. ``environment`` and ``discovery``: date (UTC), host, torch and CUDA versions, the NVIDIA driver, the GPU's NVML
   name and UUID, the search_spaces/ file it matches, its supported SM clocks for each supported memory clock,
   power-limit range, the clocks seen now, and the energy counter's update period (detected by polling while the
   GPU replays the first kernel class, freqopt.gpu.replay.detect_counter_period);
b. ``kernel_classes``: every kernel class of one gpt3-small training iteration (micro-batch 4, sequence 2048)
   replayed as itself (freqopt.gpu.replay: each kernel's own operator on its traced shapes; collectives and failures
   as copies, listed in ``replayed_as_copies``) by the NVML backend at the GPU's current settings (time by CUDA
   events, energy by the counter over >= 10 updates), beside the simulated GPU's prediction at the SM clock seen;
   per class time, energy and average power and the ratios replayed/simulated, and the largest time ratio (issue
   11's target: no class more than ``TARGET_TIME_RATIO`` times its simulated time);
c. ``profile``: freqopt.measure.profile.profile for a real gpt3-small training step (micro-batch 4): the step measured
   and predicted, and the trace's kernels by kind against torch.profiler's kernels by kind;
d. ``training_steps``: whole training steps of freqopt's own modules (bf16, MixedPrecisionAdamW, as traced)
   measured (CUDA-event time over the window's steps, energy by the counter's delta over a window of at least
   ``MIN_COUNTER_UPDATES`` counter updates) against the simulated GPU's prediction of the same traced step
   (``SimulatedGPU.run(..., loop=False)``: one step from an idle GPU at default settings), for gpt3-small at
   micro-batch 1, 4, 8, gpt3-xl at 4, then gpt3-medium, gpt3-large and gpt3-2.7b at 4; each in its own try block,
   so an out-of-memory error is recorded and the rest still run.

The JSON is rewritten after each section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "experiments" / "device"
# pynvml functions that change a device or the system; every one is refused.
GUARDED_PREFIXES = ("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear", "nvmlSet", "nvmlUnitSet",
                    "nvmlDeviceCreate", "nvmlDeviceDestroy", "nvmlGpuInstanceCreate", "nvmlGpuInstanceDestroy",
                    "nvmlComputeInstanceDestroy", "nvmlDeviceModify", "nvmlDeviceRemove",
                    "nvmlDeviceDiscover")  # fmt: skip
TARGET_TIME_RATIO = 2.0  # issue 11: no kernel class replayed in more than twice its simulated time
MIN_COUNTER_UPDATES = 5  # a training-step window spans at least this many energy-counter updates
MIN_STEP_WINDOW_S = 2.0  # ... and lasts at least this long, s
WARMUP_STEPS = 3
STEP_WORKLOADS = (("gpt3-small", 1), ("gpt3-small", 4), ("gpt3-small", 8), ("gpt3-xl", 4), ("gpt3-medium", 4),
                  ("gpt3-large", 4), ("gpt3-2.7b", 4))  # fmt: skip


def install_guard(pynvml) -> list[str]:
    """Replace every function of module ``pynvml`` whose name starts with one of GUARDED_PREFIXES by one that
    raises PermissionError (naming it) without calling NVML.

    Returns:
        the names replaced, sorted.
    """

    def refuse(name: str):
        def refused(*args, **kwargs):
            raise PermissionError(f"experiments/device_check.py is read-only: refused {name}{args!r}")

        refused.__name__ = name
        return refused

    names = sorted(n for n in dir(pynvml) if n.startswith(GUARDED_PREFIXES) and callable(getattr(pynvml, n)))
    for name in names:
        setattr(pynvml, name, refuse(name))
    return names


def _dry_run_nvml():
    """A stand-in pynvml (tests/fake_pynvml.py) whose one H100 draws 400 W with a 10 ms counter, in real time."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_pynvml import FakeGPU, FakeNVML

    return FakeNVML(gpus=[FakeGPU(realtime=True, counter_period_s=0.01)], root=True).module()


def _driver(pynvml) -> str | None:
    try:
        value = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - a stand-in without it, or an old driver
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


class Check:
    """The run: where it writes, the workloads it uses (tiny ones in a dry run), what it found so far."""

    def __init__(self, out_dir: Path, dry_run: bool):
        self.out_dir, self.dry_run = out_dir, dry_run
        self.doc: dict = {"dry_run": dry_run}
        self.torch_device = "cpu" if dry_run else "cuda:0"

    def workload(self, model: str, micro_batch_size: int, seq_len: int | None = None):
        from freqopt.workload.models import Workload, get_workload
        from freqopt.workload.models.gpt3 import GPTConfig

        if self.dry_run:  # every workload stands in as one tiny GPT, so that the run takes seconds on a CPU
            return Workload(f"{model}-tiny", GPTConfig(n_layers=1, d_model=64, n_heads=4, vocab_size=256, seq_len=16),
                            micro_batch_size)  # fmt: skip
        return get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len)

    def save(self) -> None:
        from freqopt.files import atomic_write_text

        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out_dir / "device_check.json", json.dumps(self.doc, indent=1, default=str) + "\n")


def discovery(check: Check, device, pynvml) -> None:
    import torch

    spec = device.spec()
    check.doc["environment"] = {
        "when_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "driver": _driver(pynvml),
        "gpu": torch.cuda.get_device_name(0) if check.torch_device.startswith("cuda") else None,
    }  # fmt: skip
    check.doc["discovery"] = {
        "nvml_name": device.name, "uuid": device.uuid, "matched": spec.name,
        "supported_sm_clocks_mhz": {str(m): list(device.supported_sm_clocks_mhz(m))
                                    for m in device.supported_mem_clocks_mhz()},
        "power_limit_w": {"min": spec.power_limit_min_w, "max": spec.power_limit_max_w,
                          "default": spec.power_limit_default_w, "current": device.power_limit_w()},
        "clocks_now_mhz": {"sm": device.sm_clock_mhz(), "mem": device.mem_clock_mhz()},
    }  # fmt: skip
    print(json.dumps(check.doc["discovery"]["clocks_now_mhz"]), spec.name, flush=True)


def kernel_classes(check: Check, device) -> None:
    import numpy as np
    import torch

    from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting, MeasurementProtocol
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.search.units import partition
    from freqopt.workload.trace import trace_iteration

    spec = device.spec()
    protocol = (MeasurementProtocol(warmup_s=0.02, min_window_s=0.05, min_counter_updates=3) if check.dry_run
                else MeasurementProtocol(warmup_s=0.5, min_window_s=1.0, min_counter_updates=10))  # fmt: skip
    # bf16 as trained on the GPU; float32 in a dry run, as PyTorch's CPU bf16 layer-norm backward takes other
    # statistics than the meta device's and CUDA's.
    dtype = torch.float32 if check.dry_run else torch.bfloat16
    trace = trace_iteration(check.workload("gpt3-small", 4, 2048), "train", dtype=dtype)
    sim = SimulatedGPU(spec, noise=False)
    rows = []
    with NVMLBackend(device, torch_device=check.torch_device, protocol=protocol) as backend:
        for unit in partition(trace, "kernel"):
            kernels = unit.kernels(trace)
            measured = backend.measure(kernels, DEFAULT_SETTING)  # the first call also detects the counter period
            observed = int(round(measured.sm_clock_mhz))
            nearest = min(spec.sm_clocks_mhz, key=lambda f: abs(f - observed))
            predicted = sim.true_measure(kernels, ClockSetting(nearest, device.mem_clock_mhz()))
            first = kernels[0]
            rows.append({
                "unit": unit.name, "kind": first.kind, "name": first.name, "n_kernels": len(kernels),
                "replayed_as": "copy" if first.name in backend.copied_ops else "exact",
                "sm_clock_mhz_seen": observed, "time_s": measured.time_s, "energy_j": measured.energy_j,
                "avg_power_w": measured.avg_power_w, "sim_time_s": predicted.time_s,
                "sim_energy_j": predicted.energy_j, "sim_avg_power_w": predicted.avg_power_w,
                "time_ratio": measured.time_s / predicted.time_s,
                "energy_ratio": measured.energy_j / predicted.energy_j,
            })  # fmt: skip
            print(f"{first.kind:14s} {first.name:40s} {len(kernels):4d} kernels: {1e6 * measured.time_s:10.1f} us "
                  f"replayed, {1e6 * predicted.time_s:10.1f} us simulated, {measured.avg_power_w:6.0f} W replayed, "
                  f"{predicted.avg_power_w:6.0f} W simulated", flush=True)  # fmt: skip
        check.doc["discovery"]["counter_period_s"] = backend.counter_period_s
        copies = dict(backend.copied_ops)
    ratios = np.array([r["time_ratio"] for r in rows])
    worst = rows[int(np.argmax(ratios))]
    check.doc["kernel_classes"] = {
        "workload": trace.workload.model, "micro_batch_size": trace.workload.micro_batch_size,
        "seq_len": trace.workload.config.seq_len, "n_classes": len(rows), "replayed_as_copies": copies,
        "time_ratio_replayed_over_simulated": {
            "max": float(ratios.max()), "max_unit": worst["unit"], "median": float(np.median(ratios)),
            "time_weighted_mean": float(np.average(ratios, weights=[r["time_s"] for r in rows])),
            "target_max": TARGET_TIME_RATIO, "classes_over_target": [r["unit"] for r in rows
                                                                     if r["time_ratio"] > TARGET_TIME_RATIO]},
        "iteration_from_classes_s": {"replayed": float(sum(r["time_s"] for r in rows)),
                                     "simulated": float(sum(r["sim_time_s"] for r in rows))},
        "units": rows,
    }  # fmt: skip


def profile_step(check: Check, device) -> None:
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.measure.profile import profile

    with NVMLBackend(device, torch_device=check.torch_device) as backend:
        report = profile(check.workload("gpt3-small", 4, 2048), backend,
                         device="cpu" if check.dry_run else "cuda")  # fmt: skip
    check.doc["profile"] = report.summary()


def _measure_steps(check: Check, workload, device, period_s: float) -> dict:
    """Train ``workload`` on the GPU: WARMUP_STEPS steps, then steps until the window spans MIN_STEP_WINDOW_S and
    MIN_COUNTER_UPDATES counter periods; per step, time (CUDA events; perf_counter on the CPU) and energy (counter
    delta), s and J."""
    import torch

    from freqopt.workload.models import build_model
    from freqopt.workload.models.ops import MixedPrecisionAdamW
    from freqopt.workload.phases import quiet_backward_hooks

    cuda = check.torch_device.startswith("cuda")
    torch.manual_seed(0)
    model = build_model(workload.config, device=check.torch_device, dtype=torch.bfloat16 if cuda else torch.float32)
    optimizer = MixedPrecisionAdamW(model.parameters())
    shape = (workload.micro_batch_size, workload.config.seq_len)
    batches = [torch.randint(0, workload.config.vocab_size, shape, device=check.torch_device) for _ in range(4)]

    def step(i: int) -> None:
        loss = model(batches[i % 4], batches[(i + 1) % 4])
        with quiet_backward_hooks():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for i in range(WARMUP_STEPS):
        step(i)
    sync()
    window = max(MIN_STEP_WINDOW_S if not check.dry_run else 0.05, MIN_COUNTER_UPDATES * period_s)
    e0 = device.energy_j()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0, n = time.perf_counter(), 0
    while n < MIN_COUNTER_UPDATES or time.perf_counter() - t0 < window:
        step(n)
        n += 1
        if n % 4 == 0:
            sync()  # keep the host from running far ahead of the window's clock
    if cuda:
        end.record()
    sync()
    wall = time.perf_counter() - t0
    energy = device.energy_j() - e0
    elapsed = start.elapsed_time(end) / 1000.0 if cuda else wall
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del model, optimizer, batches
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"n_steps": n, "window_s": wall, "time_s": elapsed / n, "energy_j": energy / n,
            "avg_power_w": energy / elapsed, "peak_memory_gib": peak}  # fmt: skip


def training_steps(check: Check, device) -> None:
    from freqopt.gpu.backends.base import DEFAULT_SETTING
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.workload.trace import trace_training_iteration

    sim = SimulatedGPU(device.spec(), noise=False)
    period = check.doc.get("discovery", {}).get("counter_period_s") or device.spec().energy_counter_period_s
    rows = check.doc.setdefault("training_steps", [])
    for model, batch in STEP_WORKLOADS:
        row = {"model": model, "micro_batch_size": batch}
        try:
            workload = check.workload(model, batch)
            trace = trace_training_iteration(workload)
            t, e, _ = sim.run(trace.kernels, [DEFAULT_SETTING] * len(trace.kernels), loop=False)
            row["seq_len"] = workload.config.seq_len
            row["predicted"] = {"time_s": float(t.sum()), "energy_j": float(e.sum()),
                                "avg_power_w": float(e.sum() / t.sum())}  # fmt: skip
            row["measured"] = _measure_steps(check, workload, device, period)
            row["measured_over_predicted"] = {k: row["measured"][k] / row["predicted"][k]
                                              for k in ("time_s", "energy_j", "avg_power_w")}  # fmt: skip
            print(f"{model} micro-batch {batch}: {1e3 * row['measured']['time_s']:.1f} ms, "
                  f"{row['measured']['energy_j']:.1f} J measured; {1e3 * row['predicted']['time_s']:.1f} ms, "
                  f"{row['predicted']['energy_j']:.1f} J predicted", flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - out of memory, or anything else: record it, go on
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{model} micro-batch {batch}: {row['error']}", flush=True)
            _free()
        rows.append(row)
        check.save()


def _free() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


SECTIONS = (("discovery", None), ("kernel_classes", kernel_classes), ("profile", profile_step),
            ("training_steps", training_steps))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT, help="where device_check.json goes")
    parser.add_argument("--dry-run", action="store_true",
                        help="run on the CPU with a tiny model and tests/fake_pynvml.py's stand-in NVML")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=[n for n, _ in SECTIONS[1:]],
                        help="sections to leave out")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        sys.modules["pynvml"] = _dry_run_nvml()
    import pynvml

    check = Check(args.out_dir, args.dry_run)
    check.doc["guarded_nvml_functions"] = install_guard(pynvml)  # before anything touches the GPU
    from freqopt.gpu.nvml import open_devices

    device = open_devices(read_only=True)[0]
    discovery(check, device, pynvml)
    check.save()
    failed = False
    for name, section in SECTIONS[1:]:
        if name in args.skip:
            continue
        started = time.perf_counter()
        try:
            section(check, device)
        except Exception as e:  # noqa: BLE001 - keep the other sections
            check.doc.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed = True
            _free()
        check.doc.setdefault("section_wall_s", {})[name] = time.perf_counter() - started
        check.save()
    print(f"wrote {check.out_dir / 'device_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
