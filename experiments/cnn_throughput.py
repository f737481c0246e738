"""A standard CNN's training throughput on the simulated GPU beside the published measurement (issue 36, item 3).

    python experiments/cnn_throughput.py

ResNet-50 v1.5 (He et al. 2016, "Deep Residual Learning for Image Recognition", CVPR, table 1; v1.5: the stride on
each downsampling bottleneck's 3x3 convolution, as NVIDIA's recipe has it), written here from the paper's table,
traced with freqopt.trace_step: batch 256 of 224 x 224 images, channels-last, bf16, SGD with momentum, and
profiled on the simulated GPUs (freqopt.profile of the trace, default settings). Its convolutions are cuDNN's
implicit GEMMs on tensor cores (freqopt.workload.trace's kinds; K = C_in x kh x kw: physics.gemm_inner_dim).

Published (NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
performance results", pytorch-21.03 NGC container, mixed precision, 1 GPU): 2470 img/s on an A100 80GB (DGX A100),
1200 img/s on a V100 16GB (DGX-1). Their runs train with AMP (fp32 weights, the forward under autocast in fp16),
which the trace now follows (issue 49); they also include what it does not: DALI's data pipeline, GradScaler's loss
scaling, label smoothing.

Writes experiments/cnn/report.md and results.json.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import freqopt

OUT = Path(__file__).resolve().parent / "cnn"
BATCH = 256
PUBLISHED = {"a100-sxm4-80gb": (2470, "A100 80GB (DGX A100), mixed precision"),
             "v100-sxm2": (1200, "V100 16GB (DGX-1), mixed precision")}  # img/s, NVIDIA DeepLearningExamples



class Bottleneck(nn.Module):
    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = 4 * width
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False); self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False); self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False); self.bn3 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, n_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        layers, c = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(c, width, stride if i == 0 else 1)); c = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# How the step keeps its numbers: "bf16" (bf16 weights and activations, as this experiment traced it before issue 49)
# or automatic mixed precision as the published runs and most users train, fp32 weights with the forward under
# torch.autocast("cuda", dtype): "amp-fp16" (NVIDIA's recipe: torch.cuda.amp's default dtype; the V100 has no bf16)
# and "amp-bf16". freqopt.trace_step traces autocast as the GPU runs it (freqopt.workload.autocast, issue 49, item 3).
PRECISIONS = {"bf16": None, "amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}
# Which GPU is judged on which trace: the published throughputs ran AMP (fp16); the H200's rows are predictions,
# registered before a real ResNet-50 step on it is compared (the team holds one back).
ROWS = [("a100-sxm4-80gb", "amp-fp16"), ("v100-sxm2", "amp-fp16"), ("a100-sxm4-80gb", "bf16"), ("v100-sxm2", "bf16"),
        ("h200-sxm", "amp-bf16"), ("h200-sxm", "bf16")]


def trace_resnet50(precision: str = "amp-fp16"):
    """One training step of ResNet-50 at BATCH, traced on the meta device in ``precision`` (PRECISIONS), channels-last,
    SGD with momentum."""
    autocast = PRECISIONS[precision]
    with torch.device("meta"):
        model = ResNet50().to(torch.float32 if autocast else torch.bfloat16).to(memory_format=torch.channels_last)
        images = torch.randn(BATCH, 3, 224, 224, dtype=torch.float32 if autocast else torch.bfloat16)
        images = images.to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (BATCH,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)

    def step():
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return freqopt.trace_step(step, name=f"resnet50-{precision}", module=model, micro_batch_size=BATCH)


def main() -> None:
    traces = {p: trace_resnet50(p) for p in dict.fromkeys(p for _, p in ROWS)}
    rows = []
    for gpu, precision in ROWS:
        published, what = PUBLISHED.get(gpu, (None, "no published figure: a prediction"))
        report = freqopt.profile(traces[precision], gpu=gpu)
        simulated = BATCH / report.time_s
        rows.append({"gpu": gpu, "precision": precision, "published_img_s": published, "published": what,
                     "simulated_img_s": simulated, "ratio": simulated / published if published else None,
                     "step_s": report.time_s, "waiting_s": report.waiting_s, "host": report.host,
                     "by_kind_s": {k: f.time_s for k, f in report.by_kind.items()}})  # fmt: skip
    OUT.mkdir(exist_ok=True)
    doc = {"date": datetime.date.today().isoformat(), "batch": BATCH,
           "tflop_per_step": {p: t.total_flops / 1e12 for p, t in traces.items()},
           "kernels_per_step": {p: len(t) for p, t in traces.items()}, "rows": rows}  # fmt: skip
    (OUT / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    judged = [r for r in rows if r["ratio"] is not None and r["precision"] == "amp-fp16"]
    met = all(abs(r["ratio"] - 1) <= 0.20 for r in judged)
    lines = ["# ResNet-50 training throughput: simulated against published (issue 36, item 3; issue 49)", "",
             f"Written by `python experiments/cnn_throughput.py` on {doc['date']} (its docstring says what it traces "
             f"and where the published figures come from). Batch {BATCH}; "
             + ", ".join(f"{p}: {len(traces[p])} kernels" for p in traces) + " per step. Each GPU is issued by its "
             "file's host (freqopt.gpu.host; `GPU waiting` is the step's wait on it).", "",
             "| GPU | trace | published (img/s) | simulated (img/s) | simulated / published | step (ms): GEMMs and "
             "convolutions, elementwise, GPU waiting |", "|---|---|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        k = r["by_kind_s"]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"| {r['gpu']} ({r['published']}) | {r['precision']} | {r['published_img_s'] or '-'} | "
                     f"{r['simulated_img_s']:.0f} | {ratio} | {1e3 * r['step_s']:.1f}: {1e3 * k.get('gemm', 0):.1f}, "
                     f"{1e3 * k.get('elementwise', 0):.1f}, {1e3 * (r['waiting_s'] or 0):.1f} |")  # fmt: skip
    bn_rel = freqopt.get_gpu("h200-sxm").operator_bandwidth_rel["aten.native_batch_norm"]
    verdicts = ", ".join(f"{'met' if abs(r['ratio'] - 1) <= 0.20 else '**not met**'} on the {r['gpu']} "
                         f"({r['ratio']:.2f})" for r in judged)  # fmt: skip
    lines += ["", "Reading: issue 36's target, within 20 % of the published throughput on the trace the published runs "
              f"used (AMP with fp16: fp32 weights, the forward under autocast), is {verdicts}"
              + ("" if met else "; the simulated steps are slower than measured where the ratio is below 1") + ". The "
              "convolutions' efficiency by direction and the batch norm's bandwidth are measured on the H200 "
              "(experiments/h200_check.md) and carried to the A100 and the V100 as relative figures (against each "
              "GPU's own GEMM model and copy bandwidth: an assumption across dies, their files' [provenance]); batch "
              f"norm's, {bn_rel:.2f} of a copy's bandwidth forward, is most of the step's elementwise time. Not "
              "modelled: the published runs' data pipeline (DALI), GradScaler's loss scaling and label smoothing. The "
              "bf16 rows are the trace this experiment used before (bf16 weights); the H200's rows are predictions "
              "registered before a real ResNet-50 step is compared."]  # fmt: skip
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
