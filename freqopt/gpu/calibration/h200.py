"""The simulated GH100's kernel families fitted on a real H200's kernels by shape (shared/calibration/h200/, copied to
experiments/data/h200/), each judged on the shapes it was not fitted on (leave one shape out).

A real H200 (read-only, default settings, 2026-11-28) timed bf16 kernels one shape at a time: cuBLAS GEMMs, PyTorch's
default fused attention (SDPA) forward and backward, layer norm, RMS norm, GELU, SiLU and an add forward and backward
at 768-4096 columns, cross-entropy with Hugging Face's fp32 upcast (``kernel_atlas.json``), and every convolution
(forward, data gradient, weight gradient) and batch norm + ReLU of ResNet-50 at batch 256 (``convolutions.json``).
Each *point* here is one such timing with the kernels freqopt's tracer records for the same call
(freqopt.workload.step_trace on the meta device: the same bytes and FLOPs a traced model's kernels carry), so what is
fitted is what the simulator computes for a user's model.

**What a timing holds.** Each is the mean of 20 calls of the operator in a Python loop timed by CUDA events, so it
cannot be shorter than the host's time per call: where the kernels take less, the loop times the host
(``HARNESS``). The backward timings show it plainly: an add's backward, whose gradient is passed through without a
kernel worth the name, took 50-79 us at every width, as long as a layer norm's; and torch.profiler's device time of
the same kernels inside a training step on the same GPU (device_check.json's profile: 106 elementwise kernels of
gpt3-small in 1.99 ms, 19 us each) is far below them. A point is therefore predicted as
``max(h, t)``: ``t`` the simulated kernels' time, ``h`` the harness's host time per call of its kind (fitted with
the family, a property of the measuring machine, not of the GPU; never written to a GPU file).

**At which clock.** The atlas does not record the SM clock per shape. Its loops are short (25 calls: 1 to 35 ms but for
the 16384^3 GEMM) next to the firmware's response to the power limit, so the points are simulated at the highest
clocks without the limit. Evidence: the 8192^3 GEMM ran at 800 TFLOP/s in the atlas and at 641 TFLOP/s sustained for
6 s (waiting_power.json, median clock 1485 MHz); the 16384^3 GEMM (12.5 ms a call) did throttle, and is the point
this assumption misses.

**Families and what each fits** (``FAMILIES``; each family's points, with the families fitted before it held):

* GEMM: ``gemm_efficiency``, ``gemm_k_overhead`` (K), ``gemm_tile_overhead`` (output tiles), ``gemm_fixed_us``;
* attention forward: ``attention_efficiency``, ``attention_head_dim_overhead`` (d), ``attention_key_overhead``
  (keys per query block), its fixed time; attention backward: ``attention_backward_efficiency_rel`` and its fixed
  time (the d and key terms the forward's). The atlas's attention is PyTorch's default SDPA on Hopper, cuDNN's
  fused kernel (the H100 steps' torch.profiler names it ``cudnn_generated_fort_native_sdpa_sm90_flash_*`` for the
  same calls), so the fitted model is cuDNN's; ``freqopt.flash_attention`` calls FlashAttention-2
  (``aten._scaled_dot_product_flash_attention``), whose rate relative to it (``attention_rate_rel``) is fitted on
  the two kernels device_check replayed at gpt3-small's shape (one shape: no leave-one-out there);
* convolution forward, data gradient, weight gradient: ``conv_efficiency_rel`` of each direction (on the GEMM
  family's K and tile terms: cuDNN's implicit GEMM);
* batch norm forward and backward: the bandwidth of ``aten.native_batch_norm`` and its backward relative to a copy's;
* memory-bound forward and backward, cross-entropy: no GPU constant is fitted here. Their kernel model is the H100's,
  fitted on torch.profiler's device time of whole steps (freqopt.gpu.calibration.h100_steps) and carried to the H200
  by its memory bandwidth; the atlas checks it, with only the harness's host time fitted where it binds.

``leave_one_out`` refits a family without each of its points in turn (the harness's host time included), and the
families whose values its predictions use (``Family.uses``: the attention backward runs on the forward's d and key
terms; a backward timed as a difference holds its forward) without that shape too, and predicts that point: the
fidelity figure experiments/h200_check.md reports, beside the in-sample residuals. A point the measuring loop's host
binds (``bound`` "harness") checks the loop, not a kernel model, and is reported apart.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freqopt.gpu.backends.physics import KernelPhysics
from freqopt.gpu.calibration.h100 import SDPA_ATTENTION
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Kernel

__all__ = ["KernelPoint", "Family", "FAMILIES", "HARNESS", "load_atlas", "load_convolutions", "load_replayed",
           "load_replayed_gemms", "load_sustained_gemm", "predict", "fit_family", "fit", "leave_one_out", "with_values", "current_values", "kernel_time_s",
           "FA2_NAMES", "SDPA_ATTENTION"]  # fmt: skip

FA2_NAMES = ("freqopt.flash_attention", "freqopt.flash_attention_backward")  # FlashAttention-2 (freqopt's models)

# The harness's host time per call, by what the call runs (a point's ``harness``): (lower, upper, start), us.
HARNESS: dict[str, tuple[float, float, float]] = {
    "gemm": (0.0, 60.0, 20.0),  # torch.mm: one cuBLAS call
    "replay": (0.0, 60.0, 15.0),  # freqopt's NVML backend replaying a traced kernel (freqopt.gpu.replay)
    "sdpa forward": (0.0, 100.0, 20.0),
    "sdpa backward": (0.0, 200.0, 60.0),  # through autograd
    "memory-bound forward": (0.0, 60.0, 10.0),
    "memory-bound backward": (0.0, 200.0, 60.0),  # through autograd
    "norm forward": (0.0, 60.0, 15.0),  # layer and RMS norm: a weight (and a bias) besides the input
    "batch norm forward": (0.0, 400.0, 100.0),  # batch norm + ReLU under autocast: casts, statistics, running stats
    "batch norm backward": (0.0, 600.0, 250.0),
}


@dataclass(frozen=True)
class KernelPoint:
    """One measured shape.

    Attributes:
        family: its family (FAMILIES).
        label: the shape, for people (``8192x768x3072``).
        kernels: what freqopt's tracer records for the call, as the GPU runs it.
        measured_s: time per call, s (CUDA events, mean of 20).
        harness: the kind of call (HARNESS), whose host time per call bounds the timing; None where none does.
        forward: for a backward timed as the difference of a loop of forward and backward and a loop of the forward
            alone, the forward's kernels (then ``forward_harness`` its harness key); None for a call timed alone.
        sm_clock_mhz: the SM clock the GPU ran at, where the measurement says (a replay's sample, a sustained loop's
            median); None: the highest (module docstring).
    """

    family: str
    label: str
    kernels: tuple[Kernel, ...]
    measured_s: float
    harness: str | None = None
    forward: tuple[Kernel, ...] | None = None
    forward_harness: str | None = None
    sm_clock_mhz: float | None = None


@dataclass(frozen=True)
class Family:
    """A kernel family: the GPUSpec values it fits, (lower, upper, start) each, and the harness keys it fits.
    Families of one ``group`` are fitted together (the convolutions share the GEMM's main-loop efficiency and
    epilogue: cuDNN's implicit GEMMs), each still judged on its own points. ``uses``: the families fitted before it
    whose values (constants and harness times) enter its predictions (a backward's kernels run on the forward's
    attention constants; a backward timed as a difference holds the forward's kernels and loop), so that leaving a
    shape out refits them without that shape as well (``leave_one_out``)."""

    name: str
    parameters: dict[str, tuple[float, float, float]]
    harness: tuple[str, ...] = ()
    group: str | None = None
    uses: tuple[str, ...] = ()

    @property
    def fit_group(self) -> str:
        return self.group or self.name


FAMILIES: list[Family] = [
    Family("GEMM", {"gemm_efficiency": (0.3, 1.2, 0.8), "gemm_epilogue_rel": (0.0, 3.0, 1.0),
                    "gemm_fixed_us": (0.0, 30.0, 3.0), "gemm_unclocked_share": (0.0, 0.9, 0.2)}, ("gemm", "replay")),
    Family("attention forward", {"attention_efficiency": (0.1, 1.2, 0.5), "attention_head_dim_overhead": (0.0, 2000.0, 70.0),
                                 "attention_key_overhead": (0.0, 5000.0, 100.0),
                                 "attention_fixed_forward_us": (0.0, 100.0, 10.0)}, ("sdpa forward",)),
    Family("attention backward", {"attention_backward_efficiency_rel": (0.2, 1.5, 0.8),
                                  "attention_fixed_backward_us": (0.0, 200.0, 30.0)}, ("sdpa backward",),
           uses=("attention forward",)),
    Family("FlashAttention-2 forward", {"rate/freqopt.flash_attention": (0.2, 2.0, 0.7)}),
    Family("FlashAttention-2 backward", {"rate/freqopt.flash_attention_backward": (0.2, 2.0, 0.7)}),
    Family("memory-bound forward", {"layer_norm_bandwidth_rel": (0.1, 1.5, 0.5),
                                    "row/aten.native_layer_norm": (0.0, 5000.0, 300.0),
                                    "bw/aten._fused_rms_norm": (0.1, 1.5, 0.7)}, ("memory-bound forward", "norm forward")),
    Family("memory-bound backward", {}, ("memory-bound backward",), uses=("memory-bound forward",)),
    Family("cross-entropy forward", {"bw/aten._log_softmax": (0.1, 1.5, 0.75)}),
    Family("cross-entropy backward", {"bw/aten._log_softmax_backward_data": (0.1, 1.5, 0.75)},
           uses=("cross-entropy forward",)),
    Family("convolution forward", {"conv/forward": (0.2, 2.0, 0.8), "conv/forward_small_channels": (0.01, 2.0, 0.3)},
           group="GEMM"),
    Family("convolution data gradient", {"conv/input": (0.2, 2.0, 0.8), "conv/input_small_channels": (0.01, 2.0, 0.3)},
           group="GEMM"),
    Family("convolution weight gradient", {"conv/weight": (0.2, 2.0, 0.8),
                                           "conv/weight_small_channels": (0.01, 2.0, 0.3)}, group="GEMM"),
    Family("batch norm forward", {"bw/aten.native_batch_norm": (0.05, 1.5, 0.5)}, ("batch norm forward",)),
    Family("batch norm backward", {"bw/aten.native_batch_norm_backward": (0.05, 1.5, 0.5)}, ("batch norm backward",),
           uses=("batch norm forward",)),
]  # fmt: skip
_FAMILY = {f.name: f for f in FAMILIES}


# -- points ------------------------------------------------------------------------------------------------------
def _trace(step: Callable[[], None]) -> list[Kernel]:
    from freqopt.workload.step_trace import trace_step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a lone operator's step: no module to warn about
        return list(trace_step(step, name="atlas", warmup=0).kernels)


def _meta(*shape, dtype=None, grad: bool = False):
    import torch

    return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16, requires_grad=grad)


def _passes(kernels: list[Kernel], *, min_bytes: float = 1e5) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """(forward, backward) kernels of a traced call, without the scalar kernels the step's scaffolding adds (the
    loss's ones gradient, a parameter's zero fill)."""
    keep = [k for k in kernels if k.mem_bytes >= min_bytes or k.flops > 0]
    return (tuple(k for k in keep if k.pass_name == "forward"), tuple(k for k in keep if k.pass_name == "backward"))


def _gemm_point(r: dict) -> KernelPoint:
    m, n, k = r["m"], r["n"], r["k"]

    def step():
        (_meta(m, k, grad=True) @ _meta(k, n)).sum().backward()

    forward, _ = _passes(_trace(step))
    gemm = tuple(kk for kk in forward if kk.kind == "gemm")
    return KernelPoint("GEMM", f"{m}x{n}x{k}", gemm, r["s"], "gemm")


def _rename(kernels: Sequence[Kernel], names: tuple[str, str]) -> tuple[Kernel, ...]:
    """Attention kernels renamed to another implementation's (forward, backward) operator names."""
    return tuple(dataclasses.replace(k, name=names[1] if k.name.endswith("_backward") else names[0]) if k.kind == "attention"
                 else k for k in kernels)  # fmt: skip


def _attention_kernels(b: int, h: int, s: int, d: int, causal: bool, names: tuple[str, str]) -> tuple[tuple, tuple]:
    from freqopt.workload.models.ops import flash_attention

    def step():
        q, k, v = (_meta(b, h, s, d, grad=True) for _ in range(3))
        flash_attention(q, k, v, causal).sum().backward()

    attention = [k for k in _trace(step) if k.kind == "attention"]
    forward = _rename([k for k in attention if k.pass_name == "forward"], names)
    backward = _rename([k for k in attention if k.pass_name == "backward"], names)
    return forward, backward


def _sdpa_points(r: dict) -> list[KernelPoint]:
    b, h, s, d, causal = r["b"], r["heads"], r["seq"], r["head_dim"], bool(r["causal"])
    forward, backward = _attention_kernels(b, h, s, d, causal, SDPA_ATTENTION)
    label = f"b{b} h{h} s{s} d{d}{' causal' if causal else ''}"
    return [KernelPoint("attention forward", label, forward, r["fwd_s"], "sdpa forward"),
            KernelPoint("attention backward", label, backward, r["bwd_s"], "sdpa backward", forward, "sdpa forward")]  # fmt: skip


def _fused_rms_norm(tokens: int, width: int) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """RMS norm as PyTorch runs it on CUDA: one fused row kernel each way (``aten._fused_rms_norm``, PyTorch >= 2.9),
    as layer norm's; the meta device decomposes it into a dozen kernels, which the GPU does not run."""
    x, w, row = 2 * tokens * width, 2 * width, 4 * tokens  # bytes: bf16 rows, the weight, fp32 rstd per row
    forward = Kernel("aten._fused_rms_norm", "normalization", "forward", 0.0, float(2 * x + w + row), "bfloat16",
                     ((tokens, width), (width,)))  # fmt: skip
    backward = Kernel("aten._fused_rms_norm_backward", "normalization", "backward", 0.0, float(3 * x + 2 * w + row),
                      "bfloat16", ((tokens, width), (tokens, width), (tokens, 1), (width,)))  # fmt: skip
    return (forward,), (backward,)


def _memory_bound_points(r: dict) -> list[KernelPoint]:
    import torch.nn.functional as F

    op, tokens, width = r["op"], r["tokens"], r["width"]
    if op == "rms_norm":
        forward, backward = _fused_rms_norm(tokens, width)
    else:
        calls = {"layer_norm": lambda x: F.layer_norm(x, (width,), _meta(width, grad=True), _meta(width, grad=True)),
                 "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
                 "add": lambda x: x + 1.0}  # the atlas counts twice the input's bytes: a scalar add

        def step():
            x = _meta(tokens, width, grad=True)
            y = calls[op](x)
            y.backward(_meta(tokens, width))

        forward, backward = _passes(_trace(step))
    label = f"{op} {tokens}x{width}"
    norm = op in ("layer_norm", "rms_norm")
    forward_harness = "norm forward" if norm else "memory-bound forward"
    return [KernelPoint("memory-bound forward", label, forward, r["fwd_s"], forward_harness),
            KernelPoint("memory-bound backward", label, backward, r["bwd_s"], "memory-bound backward", forward,
                        forward_harness)]  # fmt: skip


def _cross_entropy_points(r: dict) -> list[KernelPoint]:
    import torch
    import torch.nn.functional as F

    tokens, vocab = r["tokens"], r["width"]

    def step():  # Hugging Face's ForCausalLMLoss: logits.float(), then cross-entropy
        logits = _meta(tokens, vocab, grad=True)
        F.cross_entropy(logits.float(), torch.empty(tokens, dtype=torch.long, device="meta")).backward()

    forward, backward = _passes(_trace(step))
    label = f"{tokens}x{vocab}"
    return [KernelPoint("cross-entropy forward", label, forward, r["fwd_s"]),
            KernelPoint("cross-entropy backward", label, backward, r["bwd_s"], forward=forward)]  # fmt: skip


def load_atlas(path: str | Path) -> list[KernelPoint]:
    """The points of kernel_atlas.json: GEMMs, attention, memory-bound operators, cross-entropy."""
    atlas = json.loads(Path(path).read_text())
    points = [_gemm_point(r) for r in atlas["gemm"]]
    points += [p for r in atlas["sdpa"] for p in _sdpa_points(r)]
    for r in atlas["norm_elementwise_loss"]:
        points += _cross_entropy_points(r) if r["op"].startswith("cross_entropy") else _memory_bound_points(r)
    return points


def _conv_points(r: dict) -> list[KernelPoint]:
    import torch
    import torch.nn.functional as F

    def step():
        x = _meta(r["n"], r["cin"], r["h"], r["w"], grad=True).to(memory_format=torch.channels_last)
        weight = _meta(r["cout"], r["cin"] // r["groups"], r["kh"], r["kw"], grad=True)
        y = F.conv2d(x, weight, stride=r["stride"], padding=r["pad"], groups=r["groups"])
        y.backward(_meta(*y.shape).to(memory_format=torch.channels_last))  # a gradient of its own, as in a network

    kernels = [k for k in _trace(step) if "convolution" in k.name]
    by_name = {k.name: k for k in kernels}
    label = (f"{r['cin']}->{r['cout']} {r['kh']}x{r['kw']}/{r['stride']} at {r['h']}x{r['w']}"
             f" (x{r['count']})")  # fmt: skip
    return [KernelPoint("convolution forward", label, (by_name["aten.convolution"],), r["fwd_s"]),
            KernelPoint("convolution data gradient", label, (by_name["aten.convolution_backward_input"],), r["dgrad_s"]),
            KernelPoint("convolution weight gradient", label, (by_name["aten.convolution_backward_weight"],), r["wgrad_s"])]  # fmt: skip


def _batch_norm_points(r: dict) -> list[KernelPoint]:
    import torch
    import torch.nn.functional as F

    n, c, hw = r["n"], r["c"], r["hw"]

    def step():  # batch norm + ReLU on a bf16 activation, fp32 weights and statistics (autocast's mixed batch norm)
        x = _meta(n, c, hw, hw, grad=True).to(memory_format=torch.channels_last)
        weight, bias = _meta(c, dtype=torch.float32, grad=True), _meta(c, dtype=torch.float32, grad=True)
        mean, var = _meta(c, dtype=torch.float32), _meta(c, dtype=torch.float32)
        y = F.relu(F.batch_norm(x, mean, var, weight, bias, training=True))
        y.backward(_meta(n, c, hw, hw).to(memory_format=torch.channels_last))

    forward, backward = _passes(_trace(step))
    forward = tuple(k for k in forward if k.name != "aten._to_copy")  # the meta input's layout change: not timed
    label = f"{c} channels at {hw}x{hw}"
    return [KernelPoint("batch norm forward", label, forward, r["fwd_s"], "batch norm forward"),
            KernelPoint("batch norm backward", label, backward, r["bwd_s"], "batch norm backward", forward,
                        "batch norm forward")]  # fmt: skip


def load_convolutions(path: str | Path) -> list[KernelPoint]:
    """The points of convolutions.json: each convolution's three directions, each batch norm + ReLU both ways."""
    data = json.loads(Path(path).read_text())
    return [p for r in data["convs"] for p in _conv_points(r)] + [p for r in data["batchnorm_relu"] for p in _batch_norm_points(r)]


def load_replayed_gemms(path: str | Path) -> list[KernelPoint]:
    """device_check.json's GEMM classes of gpt3-small (micro-batch 4, sequence 2048), each replayed as itself on
    the H200 at default settings: time per kernel over the replay loop, at the SM clock sampled meanwhile (the power
    limit held the larger ones at 1410-1665 MHz). Family "GEMM", harness "replay"."""
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    doc = json.loads(Path(path).read_text())["kernel_classes"]
    trace = trace_training_iteration(get_workload(doc["workload"], micro_batch_size=doc["micro_batch_size"],
                                                  seq_len=doc["seq_len"]))  # fmt: skip
    by_class: dict[str, Kernel] = {}
    for k in trace.kernels:
        by_class.setdefault(k.class_key, k)
    points = []
    for u in doc["units"]:
        if u["kind"] != "gemm" or u["unit"] not in by_class:
            continue
        points.append(KernelPoint("GEMM", f"replayed {u['unit'].split('|', 3)[-1]} ({u['unit'].split('/')[0]})",
                                  (by_class[u["unit"]],), u["time_s"] / u["n_kernels"], "replay",
                                  sm_clock_mhz=float(u["sm_clock_mhz_seen"])))  # fmt: skip
    return points


def load_sustained_gemm(path: str | Path) -> KernelPoint:
    """waiting_power.json's bf16 8192^3 GEMM run for 6 s (the power limit holding the SM clock at 1320-1980 MHz,
    median 1485): time per GEMM from its repetitions over the wall time, at the median clock. Family "GEMM"."""
    state = next(s for s in json.loads(Path(path).read_text())["states"] if s["state"].startswith("bf16 GEMM"))
    n = int(state["state"].split()[-1].split("^")[0])
    point = _gemm_point({"m": n, "n": n, "k": n, "s": state["seconds"] / state["steps"]})
    return dataclasses.replace(point, label=f"{n}x{n}x{n} sustained 6 s", harness=None,
                               sm_clock_mhz=float(state["sm_mhz_median"]))


def load_replayed(path: str | Path) -> list[KernelPoint]:
    """device_check.json's FlashAttention-2 kernels at gpt3-small's shape (micro-batch 4, sequence 2048), replayed
    as themselves on the H200 (freqopt's NVML backend: time per kernel over the replay loop): the points that fit
    ``attention_rate_rel``. Families "FlashAttention-2 forward" and "... backward"."""
    units = json.loads(Path(path).read_text())["kernel_classes"]["units"]
    points = []
    for u in units:
        if u["kind"] != "attention":
            continue
        b, h, s, d = map(int, u["unit"].split("|")[3].split(",")[0].split("x"))
        forward, backward = _attention_kernels(b, h, s, d, True, FA2_NAMES)
        backward_pass = u["name"].endswith("_backward")
        points.append(KernelPoint(f"FlashAttention-2 {'backward' if backward_pass else 'forward'}", f"b{b} h{h} s{s} d{d} causal",
                                  backward if backward_pass else forward, u["time_s"] / u["n_kernels"]))  # fmt: skip
    return points


# -- the model ---------------------------------------------------------------------------------------------------
def with_values(spec: GPUSpec, values: dict[str, float]) -> GPUSpec:
    """``spec`` with family values set: GPUSpec fields by name (``gemm_fixed_us`` and the attention's fixed times in
    us), ``conv/<direction>`` into ``conv_efficiency_rel``, ``bw/<operator>`` into ``operator_bandwidth_rel``,
    ``rate/<operator>`` into ``attention_rate_rel``. Harness keys are ignored."""
    fields, conv = {}, dict(spec.conv_efficiency_rel)
    bandwidth, rate = dict(spec.operator_bandwidth_rel), dict(spec.attention_rate_rel)
    rows = dict(spec.row_overhead_elements)
    fixed = list(spec.attention_fixed_s)
    for key, value in values.items():
        if key in HARNESS:
            continue
        if key.startswith("conv/"):
            conv[key.removeprefix("conv/")] = value
        elif key.startswith("bw/"):
            bandwidth[key.removeprefix("bw/")] = value
        elif key.startswith("rate/"):
            rate[key.removeprefix("rate/")] = value
        elif key.startswith("row/"):
            rows[key.removeprefix("row/")] = value
        elif key == "gemm_fixed_us":
            fields["gemm_fixed_s"] = value * 1e-6
        elif key == "attention_fixed_forward_us":
            fixed[0] = value * 1e-6
        elif key == "attention_fixed_backward_us":
            fixed[1] = value * 1e-6
        else:
            fields[key] = value
    return dataclasses.replace(spec, conv_efficiency_rel=conv, operator_bandwidth_rel=bandwidth,
                               attention_rate_rel=rate, row_overhead_elements=rows, attention_fixed_s=tuple(fixed),
                               **fields)  # fmt: skip


def current_values(spec: GPUSpec, names) -> dict[str, float]:
    """The values of ``names`` (family keys, as ``with_values`` takes them) in ``spec``; NaN where it has none."""
    out = {}
    for key in names:
        if key.startswith("conv/"):
            out[key] = spec.conv_efficiency_rel.get(key.removeprefix("conv/"), math.nan)
        elif key.startswith("bw/"):
            out[key] = spec.operator_bandwidth_rel.get(key.removeprefix("bw/"), math.nan)
        elif key.startswith("rate/"):
            out[key] = spec.attention_rate_rel.get(key.removeprefix("rate/"), math.nan)
        elif key.startswith("row/"):
            out[key] = spec.row_overhead_elements.get(key.removeprefix("row/"), math.nan)
        elif key == "gemm_fixed_us":
            out[key] = spec.gemm_fixed_s * 1e6
        elif key == "attention_fixed_forward_us":
            out[key] = spec.attention_fixed_s[0] * 1e6
        elif key == "attention_fixed_backward_us":
            out[key] = spec.attention_fixed_s[1] * 1e6
        else:
            out[key] = float(getattr(spec, key))
    return out


def kernel_time_s(spec: GPUSpec, kernels: Sequence[Kernel], sm_clock_mhz: float | None = None) -> float:
    """The kernels' simulated time at the highest memory clock and ``sm_clock_mhz`` (the supported clock nearest
    it; None: the highest), no power limit, no host: the physics alone
    (freqopt.gpu.backends.physics.KernelPhysics), s."""
    if not kernels:
        return 0.0
    mem = np.full(len(kernels), float(spec.max_mem_clock_mhz))
    column = -1 if sm_clock_mhz is None else int(np.argmin(np.abs(np.asarray(spec.sm_clocks_mhz) - sm_clock_mhz)))
    return float(KernelPhysics(spec, list(kernels), mem).time_s[:, column].sum())


def predict(spec: GPUSpec, point: KernelPoint, harness_us: dict[str, float] | None = None) -> float:
    """A point's predicted time, s: its kernels' (``kernel_time_s``), or the harness's host time per call of its
    kind (``harness_us``, us) where that is longer. A backward timed as a difference (``point.forward``) is
    ``max(H_f + H_b, G_f + G_b) - max(H_f, G_f)``: the loop of both passes, less the loop of the forward, each as
    long as its host or its GPU takes (H the harness's host times, G the kernels')."""
    harness_us = harness_us or {}
    host = harness_us.get(point.harness, 0.0) * 1e-6 if point.harness else 0.0
    gpu = kernel_time_s(spec, point.kernels, point.sm_clock_mhz)
    if point.forward is None:
        return max(gpu, host)
    host_f = harness_us.get(point.forward_harness, 0.0) * 1e-6 if point.forward_harness else 0.0
    gpu_f = kernel_time_s(spec, point.forward, point.sm_clock_mhz)
    return max(host_f + host, gpu_f + gpu) - max(host_f, gpu_f)


def _log_errors(spec: GPUSpec, points: Sequence[KernelPoint], harness_us: dict[str, float]) -> list[float]:
    return [100 * math.log(predict(spec, p, harness_us) / p.measured_s) for p in points]


def _group(name: str) -> list[Family]:
    group = _FAMILY[name].fit_group
    return [f for f in FAMILIES if f.fit_group == group]


def fit_family(spec: GPUSpec, points: Sequence[KernelPoint], family: str,
               harness_us: dict[str, float] | None = None, *, harness_only: bool = False) -> tuple[GPUSpec, dict[str, float]]:
    """Fit one family's parameters and harness keys, with those of the families fitted in its group, to the group's
    points (scipy.optimize.least_squares, trust-region reflective, on the log ratio of predicted to measured time in
    %), the rest of ``spec`` held. A parameter no point of the group exercises keeps its value in ``spec``;
    ``harness_only`` fits only the harness times (the committed constants held).

    Returns:
        (``spec`` with the fitted values, the harness times: ``harness_us`` updated with the group's).

    Raises:
        ValueError: no point of the family's group.
    """
    from scipy.optimize import least_squares

    families = _group(family)
    names_in = {f.name for f in families}
    mine = [p for p in points if p.family in names_in]
    if not mine:
        raise ValueError(f"no point of family {family!r} or its group")
    harness = dict(harness_us or {})
    parameters = {} if harness_only else {k: v for f in families for k, v in f.parameters.items() if _exercised(k, mine)}
    used = [h for f in families for h in f.harness if any(p.harness == h or p.forward_harness == h for p in mine)]
    used = [h for h in used if any(p.harness == h for p in mine)]  # fitted where it is a point's own harness
    names = list(parameters) + used
    if not names:
        return spec, harness
    # A harness time starts at the shortest timing it bounds (it can be no longer): started lower, a max() with
    # kernels that take longer has no gradient to move it.
    bounds = [parameters[n] if n in parameters
              else (*HARNESS[n][:2], min(HARNESS[n][1], min(p.measured_s for p in mine if p.harness == n) * 1e6))
              for n in names]  # fmt: skip
    lower, upper, x0 = (np.array(v, dtype=float) for v in zip(*bounds))

    def fun(x):
        values = dict(zip(names, x))
        return _log_errors(with_values(spec, values), mine, {**harness, **{h: values[h] for h in used}})

    x = least_squares(fun, x0, bounds=(lower, upper), x_scale=upper - lower, max_nfev=400).x
    values = dict(zip(names, map(float, x)))
    # A harness time is free anywhere between what its points need and the shortest timing its kernels explain
    # (max() is flat there): take the least that fits as well, so that a left-out point is not floored by a value
    # no remaining point asked for.
    cost = float(np.sum(np.square(fun(x))))
    for h in used:
        low, high = HARNESS[h][0], values[h]
        for _ in range(30):
            mid = 0.5 * (low + high)
            if float(np.sum(np.square(fun([mid if n == h else values[n] for n in names])))) <= cost * (1 + 1e-6) + 1e-9:
                high = mid
            else:
                low = mid
        values[h] = high
    harness.update({h: values[h] for h in used})
    return with_values(spec, values), harness


def _exercised(key: str, points: Sequence[KernelPoint]) -> bool:
    """Whether a family key moves any of ``points``' predictions: a small-channel convolution key only where a
    convolution has fewer input channels than CONV_CHANNEL_MULTIPLE; every other key always."""
    if not key.endswith("_small_channels"):
        return True
    from freqopt.gpu.backends.physics import CONV_DIRECTIONS, conv_channels

    return any(k.name in CONV_DIRECTIONS and conv_channels(k)[0] != conv_channels(k)[1] for p in points for k in p.kernels)


def fit(spec: GPUSpec, points: Sequence[KernelPoint], families: Sequence[str] | None = None, *,
        harness_only: bool = False) -> tuple[GPUSpec, dict[str, float]]:
    """Every family of ``families`` (default: FAMILIES that have points) in FAMILIES's order, each with the ones
    before it held (``harness_only``: only the harness times, ``spec``'s constants held). Returns the fitted spec and
    the harness's host times (us)."""
    present = {p.family for p in points}
    order = [f for f in FAMILIES if f.name in present and (families is None or f.name in families)]
    harness: dict[str, float] = {}
    done: set[str] = set()
    for family in order:
        if family.fit_group not in done:
            done.add(family.fit_group)
            spec, harness = fit_family(spec, points, family.name, harness, harness_only=harness_only)
    return spec, harness


def leave_one_out(spec: GPUSpec, points: Sequence[KernelPoint], family: str,
                  harness_us: dict[str, float] | None = None, *, labels: Sequence[str] | None = None) -> list[dict]:
    """For each point of ``family``: refit the families its predictions use (``Family.uses``: the attention forward's
    constants for the backward, say) on their points of the other shapes (another label), then the family's group
    (its parameters and harness keys) on the group's other points, and predict it, so that no value fitted on the
    left-out shape enters its prediction. A point that alone exercises a parameter (a small-channel convolution, a
    family of one shape) is predicted by the fit on all points and marked ``alone``: it has no leave-one-out figure.

    Args:
        points: all points (the used families' included).
        labels: the shapes to leave out and predict (default: every point of ``family``).

    Returns:
        Per point: label, measured_s, predicted_s (left out), error_pct (of the measured), in_sample_s (the fit on
        all points), committed_s (``spec`` as given, with ``harness_us``), bound ("kernels" or "harness": which side
        of the max the left-out prediction took; a harness-bound point times the measuring loop, not the kernels),
        alone.
    """
    names_in = {f.name for f in _group(family)}
    group = [p for p in points if p.family in names_in]
    full, full_harness = fit_family(spec, group, family, harness_us)
    rows = []
    for p in [q for q in group if q.family == family and (labels is None or q.label in labels)]:
        rest = [q for q in group if q is not p]
        alone = _exercised_alone(p, rest) or not any(q.family == family for q in rest)
        if alone:
            left, left_harness = full, full_harness
        else:
            left, left_harness = _without_shape(spec, points, family, p.label, harness_us)
            left, left_harness = fit_family(left, rest, family, left_harness)
        predicted = predict(left, p, left_harness)
        gpu = kernel_time_s(left, p.kernels, p.sm_clock_mhz)
        rows.append({"label": p.label, "measured_s": p.measured_s, "predicted_s": predicted,
                     "error_pct": 100 * (predicted / p.measured_s - 1), "in_sample_s": predict(full, p, full_harness),
                     "committed_s": predict(spec, p, harness_us),
                     "bound": "harness" if p.harness and gpu < predicted * (1 - 1e-9) else "kernels", "alone": alone})  # fmt: skip
    return rows


def _without_shape(spec: GPUSpec, points: Sequence[KernelPoint], family: str, label: str,
                   harness_us: dict[str, float] | None) -> tuple[GPUSpec, dict[str, float]]:
    """``spec`` and the harness times with the families ``family`` uses (Family.uses) refitted on their points of
    shapes other than ``label``."""
    harness = dict(harness_us or {})
    for name in _FAMILY[family].uses:
        names_in = {f.name for f in _group(name)}
        others = [q for q in points if q.family in names_in and q.label != label]
        spec, harness = fit_family(spec, others, name, harness)
    return spec, harness


def _exercised_alone(point: KernelPoint, rest: Sequence[KernelPoint]) -> bool:
    keys = [k for f in FAMILIES if f.name == point.family for k in f.parameters if k.endswith("_small_channels")]
    return any(_exercised(k, [point]) and not _exercised(k, [q for q in rest if q.family == point.family]) for k in keys)
