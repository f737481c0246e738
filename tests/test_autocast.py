"""Mixed precision traced as the GPU runs it (issue 49, item 3): a step under torch.autocast("cuda", ...) on a machine
without CUDA, fp32 weights, traces bf16 GEMMs and convolutions, the ops autocast keeps in fp32, and the casts."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import get_workload
from freqopt.workload.step_trace import trace_step
from freqopt.workload.trace import trace_training_iteration


class Bottleneck(nn.Module):
    """ResNet v1.5's bottleneck (He et al. 2016, table 1; the stride on the 3x3)."""

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width)
        self.down = None
        if stride != 1 or c_in != 4 * width:
            self.down = nn.Sequential(nn.Conv2d(c_in, 4 * width, 1, stride, bias=False), nn.BatchNorm2d(4 * width))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def resnet50() -> nn.Module:
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    c_in = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(c_in, width, stride if i == 0 else 1))
            c_in = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def resnet_step(autocast: bool, batch: int = 8):
    """A ResNet-50 training step as a user writes it for AMP: fp32 weights, channels-last, SGD with momentum."""
    with torch.device("meta"):
        model = resnet50().to(memory_format=torch.channels_last)
        images = torch.randn(batch, 3, 224, 224).to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, model


def test_a_resnet50_step_under_autocast_traces_bf16_convolutions_on_a_cpu_machine():
    assert not torch.cuda.is_available()  # the case this is about: where freqopt traces
    step, model = resnet_step(autocast=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "CUDA is not available ... Disabling autocast"
        trace = trace_step(step, name="resnet50-amp", module=model, micro_batch_size=8)
    convs = [k for k in trace.kernels if "convolution" in k.name]
    assert len(convs) == 53 + 52 + 53  # 53 convolutions forward; both gradients but the stem's (its image needs none)
    assert {(k.dtype, k.tensor_core) for k in convs} == {("bfloat16", True)}
    forward = [k for k in trace.kernels if k.pass_name == "forward"]
    casts = Counter(k.shapes[0] for k in forward if k.name == "aten._to_copy" and k.dtype == "float32")
    assert casts[(64, 3, 7, 7)] == 1 and casts[(8, 3, 224, 224)] == 1  # each weight and the input cast once to bf16
    norms = [k for k in forward if k.name == "aten.native_batch_norm"]
    assert len(norms) == 53 and {k.dtype for k in norms} == {"bfloat16"}  # batch norm runs on the bf16 activation
    head = [k for k in forward if k.name == "aten.addmm"]
    assert [k.dtype for k in head] == ["bfloat16"]
    losses = [k for k in forward if k.name == "aten._log_softmax"]
    assert [k.dtype for k in losses] == ["float32"]  # cross-entropy is on autocast's fp32 list
    backward_casts = [k for k in trace.kernels if k.pass_name == "backward" and k.name == "aten._to_copy"]
    assert len(backward_casts) >= 53  # every weight's gradient cast back to fp32


@pytest.mark.slow
def test_without_autocast_the_same_step_stays_fp32_and_simulates_far_slower():
    amp, model = resnet_step(autocast=True, batch=256)  # NVIDIA's training batch: the GPU, not the host, sets the pace
    fp32, _ = resnet_step(autocast=False, batch=256)
    traced = {name: trace_step(step, name=name, module=model, micro_batch_size=256) for name, step in
              (("amp", amp), ("fp32", fp32))}  # fmt: skip
    assert not any(k.tensor_core for k in traced["fp32"].kernels)
    assert not any(k.name == "aten._to_copy" for k in traced["fp32"].kernels if k.pass_name == "forward")
    gpu = SimulatedGPU(get_gpu("h200-sxm"), noise=False)
    times = {name: gpu.step(list(trace.kernels)).time_s for name, trace in traced.items()}
    assert times["fp32"] > 2 * times["amp"]  # fp32 convolutions on CUDA cores against bf16 tensor cores


def test_a_weight_used_twice_in_one_region_is_cast_once_and_a_disabled_subregion_stays_fp32():
    with torch.device("meta"):
        w = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(16, 64)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x @ w
            y = y @ w  # the same leaf: autocast's cast cache
            with torch.autocast("cuda", enabled=False):
                z = y.float() @ w  # fp32 inside the disabled subregion
        (z.sum() + y.float().sum()).backward()

    trace = trace_step(step, name="cache")
    forward = [k for k in trace.kernels if k.pass_name == "forward"]
    weight_casts = [k for k in forward if k.name == "aten._to_copy" and k.shapes == ((64, 64),)]
    assert len(weight_casts) == 1
    gemms = [k.dtype for k in forward if k.kind == "gemm"]
    assert gemms == ["bfloat16", "bfloat16", "float32"]


def test_fp16_autocast_and_the_output_dtype_ops():
    with torch.device("meta"):
        x = torch.randn(8, 128, requires_grad=True)
        lin = nn.Linear(128, 128)

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            h = lin(x)
            p = h.softmax(-1)  # fp32_set_opt_dtype: reads fp16, writes fp32, no separate cast
        p.sum().backward()

    trace = trace_step(step, name="fp16", module=lin)
    forward = [k for k in trace.kernels if k.pass_name == "forward"]
    assert [k.dtype for k in forward if k.kind == "gemm"] == ["float16"]
    softmax = [k for k in forward if k.kind == "softmax"]
    assert len(softmax) == 1 and softmax[0].dtype == "float16"  # its input's dtype; its output is fp32
    assert not [k for k in forward if k.name == "aten._to_copy" and k.shapes == ((8, 128),) and k.dtype == "float16"]


@pytest.mark.slow
def test_trace_iteration_bf16_mixed_runs_as_trainer_bf16():
    workload = get_workload("gpt3-small", micro_batch_size=1, seq_len=256)
    bf16 = trace_training_iteration(workload)
    mixed = trace_training_iteration(workload, precision="bf16-mixed")
    gemm = {k.dtype for k in mixed.kernels if k.kind == "gemm"}
    assert gemm == {"bfloat16"}
    assert {k.dtype for k in mixed.kernels if k.kind == "normalization"} == {"float32"}  # layer norm: fp32 list
    assert any(k.name == "aten._fused_adamw_" and k.dtype == "float32" for k in mixed.kernels)
    forward_casts = [k for k in mixed.kernels if k.pass_name == "forward" and k.name == "aten._to_copy"]
    assert len(forward_casts) > len([k for k in bf16.kernels if k.pass_name == "forward" and k.name == "aten._to_copy"])
    assert not [k for k in mixed.kernels if k.pass_name == "optimizer" and k.name in ("aten.zeros", "aten.zeros_like")]
    with pytest.raises(InvalidSettingError, match="precision must be one of bf16, bf16-mixed, not 'fp8'"):
        trace_training_iteration(workload, precision="fp8")
