"""Replaying kernels as themselves (runs on CPU here; the nvml backend runs it on the GPU)."""

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from freqopt.workload.layout import Layout
from freqopt.workload.models import Workload
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.gpu.replay import COPY_OP, build_replay, detect_counter_period
from freqopt.workload.trace import OpCall, KernelRecorder, record_call, trace_iteration

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU, FakeNVML  # noqa: E402

TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)


def tiny_trace(layout: Layout = Layout()):
    # float32: PyTorch's CPU kernels take every operator of the step in it (its bfloat16 layer-norm backward wants
    # bfloat16 statistics, where CUDA's and the meta device's layer norm give float32 ones).
    return trace_iteration(Workload("tiny", TINY, 2, layout), "train", dtype=torch.float32)


class OpLog(TorchDispatchMode):
    """Lists the operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_a_single_gpu_iteration_replays_every_kernel_as_itself():
    trace = tiny_trace()
    plan = build_replay(trace.kernels, device="cpu")
    plan()
    assert plan.copies() == {}
    assert plan.modes == ["exact"] * len(trace.kernels) and all(plan.exact)
    assert plan.ops == [k.call.op for k in trace.kernels]


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(dp=2, tp=2)])
def test_the_only_copies_of_a_parallel_iteration_are_its_all_reduces(layout):
    trace = tiny_trace(layout)
    plan = build_replay(trace.kernels, device="cpu")
    plan()
    copied = [k for k, mode in zip(trace.kernels, plan.modes) if mode == "copy"]
    assert copied and copied == [k for k in trace.kernels if k.kind == "all-reduce"]
    assert list(plan.copies()) == ["freqopt.all_reduce"]
    assert "other ranks" in plan.copies()["freqopt.all_reduce"]


def test_the_plan_runs_the_traced_operators_in_order():
    trace = tiny_trace(Layout(dp=2))
    plan = build_replay(trace.kernels, device="cpu")
    with OpLog() as log:
        plan()
    expected = [COPY_OP if k.kind == "all-reduce" else k.call.op for k in trace.kernels]
    assert log.ops == expected
    gelu = [i for i, k in enumerate(trace.kernels) if k.name == "aten.gelu"]
    assert len(gelu) == TINY.n_layers and all(log.ops[i] == "aten.gelu.default" for i in gelu)
    for name in ("aten._fused_adamw_.default", "aten.native_layer_norm_backward.default",
                 "freqopt.flash_attention_backward.default", "aten._foreach_add_.Scalar"):  # fmt: skip
        assert name in log.ops


def test_exact_steps_take_the_traced_shapes_strides_and_dtypes():
    trace = tiny_trace()
    plan = build_replay(trace.kernels, device="cpu")
    for kernel, step in zip(trace.kernels, plan.steps):
        tensors = [a for a in step.args if isinstance(a, torch.Tensor)]
        specs = [a for a in kernel.call.args if hasattr(a, "stride")]
        if kernel.name == "freqopt.flash_attention_backward":  # out and logsumexp come from a forward call
            specs, tensors = specs[:4], tensors[:4]
        assert [(tuple(t.shape), t.stride(), t.dtype) for t in tensors] == [(s.shape, s.stride, s.dtype) for s in specs]
        if kernel.name == "aten.mm":
            assert step().shape == (kernel.shapes[0][0], kernel.shapes[1][1])
    transposed = [s for k in trace.kernels if k.name == "aten.mm" for s in k.call.args if s.stride[0] == 1]
    assert transposed  # the backward's transposed operands keep their layout


def test_attention_backward_reads_a_consistent_forward():
    trace = tiny_trace()
    kernel = next(k for k in trace.kernels if k.name == "freqopt.flash_attention_backward")
    plan = build_replay([kernel], device="cpu")
    step = plan.steps[0]
    assert plan.modes == ["exact"]
    grad, q, k, v, *rest = step.args
    forward = torch.ops.freqopt.flash_attention(q, k, v, kernel.causal)
    if isinstance(forward, tuple):  # the forward returns (out, logsumexp) and the backward takes both
        out, lse, _ = rest
        torch.testing.assert_close(out, forward[0])
        torch.testing.assert_close(lse, forward[1])
    dq, dk, dv = step()
    assert dq.shape == q.shape and torch.isfinite(dq).all() and torch.isfinite(dv).all()


def test_index_inputs_stay_within_the_dimension_they_index():
    trace = tiny_trace()
    plan = build_replay(trace.kernels, device="cpu")
    checked = 0
    for kernel, step, mode in zip(trace.kernels, plan.steps, plan.modes):
        a = step.args
        bound = {"aten.embedding": lambda: (a[1], a[0].shape[0]),
                 "aten.embedding_dense_backward": lambda: (a[1], a[2]),
                 "aten.nll_loss_forward": lambda: (a[1], a[0].shape[1]),
                 "aten.nll_loss_backward": lambda: (a[2], a[1].shape[1])}.get(kernel.name)  # fmt: skip
        if bound:
            index, size = bound()
            assert mode == "exact" and 0 <= int(index.min()) and int(index.max()) < size, kernel.name
            checked += 1
    assert checked == 6  # two embeddings forward and backward, the loss forward and backward
    # Equal index specs into dimensions of different sizes get different tensors.
    recorder = KernelRecorder()
    with recorder:
        idx = torch.empty(64, dtype=torch.long, device="meta")
        torch.nn.functional.embedding(idx, torch.empty(1000, 8, device="meta"))
        torch.nn.functional.embedding(idx, torch.empty(3, 8, device="meta"))
    plan = build_replay(recorder.kernels, device="cpu")
    assert plan.modes == ["exact", "exact"]
    assert int(plan.steps[1].args[1].max()) < 3 < int(plan.steps[0].args[1].max())


def test_in_place_optimizer_kernels_stay_finite_when_replayed_again_and_again():
    trace = tiny_trace()
    optimizer = [k for k in trace.kernels if k.pass_name == "optimizer"]
    plan = build_replay(optimizer, device="cpu")
    for _ in range(50):
        plan()
    adamw = plan.steps[plan.ops.index("aten._fused_adamw_.default")]
    params, grads, exp_avg, exp_avg_sq = adamw.args[:4]
    assert all(bool(torch.isfinite(t).all()) for group in (params, exp_avg_sq) for t in group)
    assert all(bool((t >= 0).all()) for t in exp_avg_sq)
    assert len({id(t) for t in params + grads + exp_avg + exp_avg_sq}) == 4 * len(params)  # no argument aliased


def test_unreplayable_kernels_fall_back_to_a_copy_of_their_bytes_visibly():
    trace = tiny_trace()
    gelu = next(k for k in trace.kernels if k.name == "aten.gelu")
    mm = next(k for k in trace.kernels if k.name == "aten.mm")
    a, b = mm.call.args
    broken = [
        dataclasses.replace(gelu, call=OpCall("aten.gelu.default", unreplayable="an argument of type Generator")),
        dataclasses.replace(gelu, call=OpCall("aten.no_such_op.default", gelu.call.args)),
        dataclasses.replace(mm, call=dataclasses.replace(mm.call, args=(a, a))),  # shapes that do not multiply
        dataclasses.replace(gelu, call=None),
    ]
    assert broken[0] == gelu and broken[0].signature == gelu.signature  # the call is not part of the kernel class
    plan = build_replay(broken, device="cpu")
    assert plan.modes == ["copy"] * 4 and plan.ops == [COPY_OP] * 4
    reasons = plan.reasons
    assert "argument of type Generator" in reasons[0]
    assert "no operator aten.no_such_op.default" in reasons[1]
    assert "aten.mm.default raised RuntimeError when tried" in reasons[2]
    assert "no recorded call" in reasons[3]
    assert plan.copies() == {"aten.gelu": reasons[0], "aten.mm": reasons[2]}
    out = plan.steps[0]()
    assert out.numel() * out.element_size() == int(gelu.mem_bytes // 2)  # a copy moving the traced bytes


def test_the_recorder_marks_arguments_it_cannot_record():
    t = torch.empty(4, 8, device="meta").t()
    call = record_call(torch.ops.aten.add.Tensor, (t, t[:, 1:2]), {"alpha": 2})
    first, second = call.args
    assert (first.shape, first.stride, first.offset) == ((8, 4), (1, 8), 0)
    assert (second.shape, second.stride, second.offset) == ((8, 1), (1, 8), 8) and call.kwargs == (("alpha", 2),)
    assert call.unreplayable is None and hash(call)
    recorder = KernelRecorder()
    with recorder:
        torch.add(t, t[:, 1:2], alpha=2)
    plan = build_replay(recorder.kernels, device="cpu")
    x, y = plan.steps[0].args
    assert plan.modes == ["exact"] and (x.stride(), y.stride(), y.storage_offset()) == ((1, 8), (1, 8), 8)
    assert plan.steps[0]().shape == (8, 4)
    bad = record_call(torch.ops.aten.add.Tensor, (t, object()), {})
    assert bad.op == "aten.add.Tensor" and bad.unreplayable == "an argument of type object"


def test_the_nvml_backend_warns_once_about_the_operators_it_copies(monkeypatch, tmp_path, caplog):
    from freqopt.gpu.backends.base import DEFAULT_SETTING, MeasurementProtocol
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    fake = FakeNVML(gpus=[FakeGPU(realtime=True, counter_period_s=0.01)])
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    kernels = list(tiny_trace(Layout(dp=2)).kernels)
    protocol = MeasurementProtocol(warmup_s=0.05, min_window_s=0.1, min_counter_updates=3)
    with caplog.at_level(logging.WARNING, logger="freqopt.gpu.backends.nvml"):
        with NVMLBackend(open_devices(read_only=True)[0], torch_device="cpu", protocol=protocol) as backend:
            backend.measure(kernels, DEFAULT_SETTING)
            backend.measure(kernels[-5:], DEFAULT_SETTING)
    warnings = [r.getMessage() for r in caplog.records if r.name == "freqopt.gpu.backends.nvml"]
    assert len(warnings) == 1 and "freqopt.all_reduce (a collective" in warnings[0]
    assert list(backend.copied_ops) == ["freqopt.all_reduce"]
    assert fake.set_calls() == []


def test_counter_period_is_detected_not_assumed():
    gpu = FakeGPU(counter_period_s=0.04, power_w=300.0)
    now = [0.0]

    def sleep(s):
        now[0] += s
        gpu.advance(s)

    period = detect_counter_period(lambda: gpu.energy_mj / 1000, duration_s=1.0, poll_s=0.001,
                                   clock=lambda: now[0], sleep=sleep)  # fmt: skip
    assert period == pytest.approx(0.04, abs=0.002)
    idle = FakeGPU(power_w=0.0)
    with pytest.raises(RuntimeError, match="changed 0 times"):
        detect_counter_period(lambda: idle.energy_mj, duration_s=0.2, poll_s=0.01, clock=lambda: now[0],
                              sleep=lambda s: now.__setitem__(0, now[0] + s))  # fmt: skip


def _device_check():
    import importlib.util

    path = Path(__file__).parent.parent / "experiments" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_device_check_refuses_every_nvml_set_call_before_nvml_sees_it(monkeypatch, tmp_path):
    from fake_pynvml import SETTERS

    from freqopt.gpu.nvml import open_devices

    device_check, _ = _device_check()
    fake = FakeNVML(root=True)  # a GPU that would allow changes
    module = fake.module()
    guarded = device_check.install_guard(module)
    assert set(SETTERS) <= set(guarded)
    with pytest.raises(PermissionError, match="read-only: refused nvmlDeviceSetGpuLockedClocks"):
        module.nvmlDeviceSetGpuLockedClocks(0, 1500, 1500)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    writable = open_devices()[0]  # even a device not opened read-only cannot get through
    for change in (lambda: writable.lock_sm_clock(1500), writable.reset_sm_clock,
                   lambda: writable.set_power_limit_w(500)):  # fmt: skip
        with pytest.raises(PermissionError, match="refused nvmlDevice"):
            change()
    assert fake.set_calls() == [] and fake.gpus[0].power_limit_mw == 700_000


@pytest.mark.slow
def test_device_check_dry_run_runs_every_section_on_the_cpu(tmp_path):
    import json
    import subprocess

    _, path = _device_check()
    run = subprocess.run([sys.executable, str(path), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "device_check.json").read_text())
    assert doc["dry_run"] and "errors" not in doc
    assert doc["environment"]["torch"] == torch.__version__ and doc["discovery"]["matched"] == "h100-sxm"
    assert doc["discovery"]["counter_period_s"] == pytest.approx(0.01, rel=0.5)
    classes = doc["kernel_classes"]
    assert classes["replayed_as_copies"] == {} and {u["replayed_as"] for u in classes["units"]} == {"exact"}
    assert classes["time_ratio_replayed_over_simulated"]["max"] > 0 and classes["n_classes"] == len(classes["units"])
    assert {"measured", "predicted", "profiler_by_kind"} <= set(doc["profile"])
    steps = doc["training_steps"]
    assert [(r["model"], r["micro_batch_size"]) for r in steps] == list(_device_check()[0].STEP_WORKLOADS)
    for row in steps:
        assert row["measured"]["n_steps"] >= 5 and row["measured"]["energy_j"] > 0 and row["predicted"]["time_s"] > 0
