"""Pipeline layouts (issue 24, item 1): pp beside dp and tp, DeepSpeed's partition methods, per-stage traces, and
the refusals where freqopt cannot handle pp > 1 yet."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch.nn as nn

from freqopt.cli import main
from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends import get_backend
from freqopt.gpu.backends.base import DEFAULT_SETTING
from freqopt.gpu.specs import get_gpu
from freqopt.workload.layout import DEEPSPEED_BUCKET_ELEMENTS, SINGLE_GPU, Layout, parse_layout
from freqopt.workload.models import build_model, get_workload
from freqopt.workload.pipeline_partition import (partition_balanced, partition_layers, partition_stages,
                                                 partition_uniform, pipeline_layers, stage_parameters)
from freqopt.workload.pipeline_trace import trace_pipeline_stages
from freqopt.workload.trace import trace_training_iteration


# -- the layout -------------------------------------------------------------------------------------------------
def test_pp_parses_prints_and_counts_gpus():
    layout = parse_layout("dp=2,tp=2,pp=4")
    assert layout == Layout(dp=2, tp=2, pp=4) and layout.world_size == 16 and layout.is_pipeline
    assert repr(layout) == "Layout(dp=2, tp=2, pp=4)" and str(layout) == "dp=2,tp=2,pp=4"
    assert layout.as_dict() == {"dp": 2, "tp": 2, "pp": 4}
    assert Layout(**layout.to_kwargs()) == layout
    assert parse_layout("pp=4, dp=2") == Layout(dp=2, pp=4) and not parse_layout("pp=4").is_single_gpu


@pytest.mark.parametrize("text", ["", "dp=1,tp=1", "dp=8,tp=4", "tp=2,pp=1"])
def test_pp_1_reads_prints_and_serializes_as_before_pp_existed(text):
    """Study names (repr), table stems and the CLI (str), tables (as_dict) and search jobs (to_kwargs, formerly
    dataclasses.asdict) of a layout without pipeline stages are what they were."""
    layout = parse_layout(text)
    dp, tp = layout.dp, layout.tp
    assert layout.pp == 1 and not layout.is_pipeline and layout.world_size == dp * tp
    assert repr(layout) == f"Layout(dp={dp}, tp={tp})" and str(layout) == f"dp={dp},tp={tp}"
    assert layout.as_dict() == {"dp": dp, "tp": tp}
    assert layout.to_kwargs() == {"dp": dp, "tp": tp, "bucket_elements": DEEPSPEED_BUCKET_ELEMENTS}
    assert repr(SINGLE_GPU) == "Layout(dp=1, tp=1)" and Layout(2, 4, 1000) == Layout(dp=2, tp=4, bucket_elements=1000)


def test_a_table_of_a_pp_1_layout_is_written_as_before():
    from freqopt.tables import workload_doc

    doc = workload_doc(get_workload("gpt3-small", layout=parse_layout("dp=2,tp=2,pp=1")))
    assert doc["layout"] == {"dp": 2, "tp": 2}
    # A pipeline's table records its stages (freqopt.tables, "Pipelines"; tests/test_pipeline_table.py).
    assert workload_doc(get_workload("gpt3-small", layout=parse_layout("dp=2,pp=2")))["layout"] == {"dp": 2, "tp": 1,
                                                                                                      "pp": 2}


@pytest.mark.parametrize("text, fragment", [("pp=0", "positive integer"), ("pp=two", "positive integer"),
                                             ("pp=2,pp=4", "twice"), ("dp=2,qq=2", "not a layout")])  # fmt: skip
def test_bad_pp_is_one_line_naming_the_layout(text, fragment):
    with pytest.raises(InvalidSettingError, match=fragment) as info:
        parse_layout(text)
    assert info.value.argument == "layout" and "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_layout_refuses_a_bad_pp(value):
    with pytest.raises(InvalidSettingError, match="layout pp must be a positive integer"):
        Layout(pp=value)


# -- the partition, against DeepSpeed's own functions -----------------------------------------------------------
ds_utils = pytest.importorskip("deepspeed.runtime.utils")


@pytest.mark.parametrize("parts", range(1, 11))
def test_partition_uniform_is_deepspeeds(parts):
    for items in range(0, 40):
        assert partition_uniform(items, parts) == list(ds_utils.partition_uniform(items, parts)), (items, parts)


def test_partition_balanced_is_deepspeeds_on_random_and_tied_weights():
    rng = random.Random(0)
    cases = []
    for _ in range(150):
        n, m = rng.randint(1, 24), rng.randint(1, 9)
        kind = rng.choice(["random", "binary", "equal", "skewed"])
        weights = {"random": [rng.randint(0, 1000) for _ in range(n)], "binary": [rng.randint(0, 1) for _ in range(n)],
                   "equal": [7] * n, "skewed": [rng.choice([1, 1, 1, 50]) for _ in range(n)]}[kind]  # fmt: skip
        cases.append((weights, m))
    for weights, m in cases:
        ours, theirs = partition_balanced(weights, m), [int(b) for b in ds_utils.partition_balanced(weights, m)]
        assert ours == theirs, (weights, m, ours, theirs)


def _deepspeed_partition(model, stages: int, method: str) -> list[int]:
    """PipelineModule._partition_layers run on freqopt's layer list: each entry an nn.Module of the layer's type
    name holding the layer's modules (as a LayerSpec would build it), in a stand-in for the PipelineModule that
    has no process group (rank 1: nothing printed)."""
    from deepspeed.runtime.pipe.module import PipelineModule

    specs = []
    for layer in pipeline_layers(model):
        entry = type(layer.type_name, (nn.Module,), {})()
        for name in layer.modules:
            entry.add_module(name.replace(".", "_"), model.get_submodule(name))
        specs.append(entry)
    fake = SimpleNamespace(num_stages=stages, _layer_specs=specs, global_rank=1, loss_fn=None,
                           _topo=SimpleNamespace(get_coord=lambda rank: SimpleNamespace(pipe=0)),
                           _set_bounds=lambda start, stop: None)  # fmt: skip
    fake._count_layer_params = lambda: PipelineModule._count_layer_params(fake)
    fake._find_layer_type = lambda name: PipelineModule._find_layer_type(fake, name)
    PipelineModule._partition_layers(fake, method)
    return [int(b) for b in fake.parts]


@pytest.mark.slow
@pytest.mark.parametrize("model, stages", [("gpt3-small", 2), ("gpt3-small", 4), ("gpt3-small", 5), ("gpt3-xl", 3),
                                           ("gpt3-xl", 8), ("gpt3-175b", 8), ("gpt3-175b", 16), ("bert-base", 3),
                                           ("bert-large", 4)])  # fmt: skip
@pytest.mark.parametrize("method", ["parameters", "uniform", "type:block", "type:^Embedding|Head"])
def test_stages_are_deepspeeds_pipelinemodule_partition(model, stages, method):
    module = build_model(get_workload(model).config)
    ours = partition_layers(pipeline_layers(module), stages, method)
    assert ours == _deepspeed_partition(module, stages, method)
    found = partition_stages(module, stages, method)
    assert [s.start for s in found] + [found[-1].stop] == ours and all(s.layers for s in found)


def test_the_layer_list_maps_freqopts_modules_as_documented():
    config = get_workload("gpt3-small").config
    layers = pipeline_layers(build_model(config))
    d, vocab = config.d_model, config.padded_vocab_size
    assert [l.type_name for l in layers] == ["EmbeddingPipe"] + ["Block"] * 12 + ["LayerNorm", "LMHeadPipe"]
    assert layers[0].n_params == (vocab + config.seq_len) * d and layers[-1].n_params == vocab * d  # tied, counted
    assert layers[-2].n_params == 2 * d
    bert = pipeline_layers(build_model(get_workload("bert-base").config))
    assert [l.type_name for l in bert] == ["EmbeddingPipe"] + ["EncoderBlock"] * 12 + ["MLMHeadPipe"]


@pytest.mark.parametrize("method, fragment", [("profile", "not one of DeepSpeed's"), ("type:attention", "matches no layer"),
                                              ("type:(", "not a regular expression"), (3, "must be a string")])  # fmt: skip
def test_bad_partition_methods_are_refused(method, fragment):
    with pytest.raises(InvalidSettingError, match=fragment) as info:
        partition_stages(build_model(get_workload("gpt3-small").config), 2, method)
    assert info.value.argument == "partition_method"


def test_more_stages_than_layers_is_refused():
    with pytest.raises(InvalidSettingError, match="pp=16 gives some stage no layer: the model has 15") as info:
        stage_parameters(get_workload("gpt3-small").config, parse_layout("pp=16"))
    assert info.value.argument == "layout"
    assert len(stage_parameters(get_workload("gpt3-small").config, parse_layout("pp=15"))) == 15


def test_stage_parameters_add_up_to_the_model_with_the_tied_weight_twice():
    config = get_workload("gpt3-small").config
    tied = config.padded_vocab_size * config.d_model
    whole = sum(p.numel() for p in build_model(config).parameters())
    assert sum(stage_parameters(config, parse_layout("pp=4"))) == whole + tied
    sharded = sum(stage_parameters(config, parse_layout("tp=2,pp=4")))
    assert whole / 2 < sharded - tied < whole  # blocks' projections halved, embeddings and norms replicated


# -- per-stage traces ---------------------------------------------------------------------------------------------
def _forward_backward(trace):
    """One micro-batch's forward and backward: without the optimizer step and the data-parallel gradient buckets
    (on the communication stream), which a pipeline runs once per iteration, not per micro-batch."""
    return [k for k in trace.kernels if k.pass_name in ("forward", "backward") and not (k.is_collective and k.stream == 1)]


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, method", [("gpt3-small", "pp=4", "parameters"), ("gpt3-small", "pp=3", "uniform"),
                                                   ("bert-base", "pp=2", "type:block"),
                                                   ("gpt3-small", "dp=2,tp=2,pp=2", "parameters")])  # fmt: skip
def test_stages_run_the_single_gpu_iterations_forward_and_backward(model, layout, method):
    """The stages' kernels, P2P aside, are the whole model's forward and backward of the same micro-batch (same
    FLOPs to the operation; with tp the same rank's shards and all-reduces), but for the one addition the single
    GPU makes of the tied weight's two gradients, which a pipeline keeps apart on its first and last stages."""
    parsed = parse_layout(layout)
    stages = trace_pipeline_stages(get_workload(model, micro_batch_size=2, layout=parsed), partition_method=method)
    single = trace_training_iteration(get_workload(model, micro_batch_size=2, layout=Layout(dp=parsed.dp, tp=parsed.tp)))
    assert len(stages) == parsed.pp and [s.index for s in stages] == list(range(parsed.pp))
    assert sum(s.total_flops for s in stages) == pytest.approx(sum(k.flops for k in _forward_backward(single)), rel=1e-12)
    ours = Counter(k.signature for s in stages for k in s.kernels if k.kind not in ("send", "recv"))
    theirs = Counter(k.signature for k in _forward_backward(single))
    missing = theirs - ours
    assert sum(missing.values()) == 1 and next(iter(missing)).startswith("elementwise|aten.add|")  # the tied gradients
    assert not ours - theirs
    assert all(k.pass_name in ("forward", "backward") for s in stages for k in s.kernels)


def test_stage_0_embeds_the_last_computes_the_loss_and_p2p_moves_the_activations():
    workload = get_workload("gpt3-small", micro_batch_size=2, layout=parse_layout("dp=2,tp=2,pp=3"))
    stages = trace_pipeline_stages(workload)
    config = workload.config
    nbytes = 2 * config.seq_len * config.d_model * 2  # micro-batch x seq_len x d_model x bf16
    names = [{k.name for k in s.kernels} for s in stages]
    assert "aten.embedding" in names[0] and not any("aten.embedding" in n for n in names[1:])
    assert "aten.nll_loss_forward" in names[-1] and not any("aten.nll_loss_forward" in n for n in names[:-1])
    p2p = [[(k.kind, k.pass_name) for k in s.p2p_kernels] for s in stages]
    assert p2p[0] == [("send", "forward"), ("recv", "backward")]
    assert p2p[1] == [("recv", "forward"), ("send", "forward"), ("recv", "backward"), ("send", "backward")]
    assert p2p[2] == [("recv", "forward"), ("send", "backward")]
    for s in stages:
        for k in s.p2p_kernels:
            assert (k.comm_bytes, k.group_size, k.group_stride, k.stream) == (nbytes, 2, 4, 0) and k.is_collective
        assert s.kernels[0].kind == ("embedding" if s.index == 0 else "recv")  # a stage starts by receiving
        tp_reduces = any(k.kind == "all-reduce" and k.group_size == 2 and k.group_stride == 1 for k in s.kernels)
        assert tp_reduces == any(l.type_name == "Block" for l in s.stage.layers)  # tp shards the blocks only
    assert stages[-1].n_params >= config.padded_vocab_size * config.d_model  # the tied output layer, replicated


def test_a_stage_is_timed_by_the_simulated_gpu_with_its_transfers():
    stages = trace_pipeline_stages(get_workload("gpt3-small", micro_batch_size=1, layout=parse_layout("pp=2")))
    backend = get_backend("sim", get_gpu("a100-sxm4-80gb"))
    trace = stages[1].as_trace()
    assert trace.meta["stage"] == 1 and trace.meta["layout"] == {"dp": 1, "tp": 1, "pp": 2}
    times = backend.kernel_times_s(trace.kernels, DEFAULT_SETTING)
    p2p = [i for i, k in enumerate(trace.kernels) if k.kind in ("send", "recv")]
    assert len(p2p) == 2 and all(times[i] > 0 for i in p2p)
    link = backend.spec.interconnect
    assert times[p2p[0]] >= trace.kernels[p2p[0]].comm_bytes / (link.link_bandwidth_gbs * 1e9)


# -- where pp > 1 is refused --------------------------------------------------------------------------------------
def test_whole_iteration_tracing_refuses_a_pipeline():
    with pytest.raises(InvalidSettingError, match="tracing one rank's whole iteration does not handle pipelines.*"
                                                  "trace_pipeline_stages") as info:  # fmt: skip
        trace_training_iteration(get_workload("gpt3-small", layout=parse_layout("pp=2")))
    assert info.value.argument == "layout"


def test_search_profile_and_training_refuse_a_pipeline(tmp_path):
    import freqopt
    from freqopt.apply.train import plan_training

    with pytest.raises(InvalidSettingError, match="layout dp=1,tp=1,pp=2: freqopt.search searches one GPU's "
                                                  "iteration; search a pipeline.*search_pipeline"):  # fmt: skip
        freqopt.search("gpt3-small", max_slowdown="1%", layout="pp=2", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidSettingError, match="the profile does not handle pipelines"):
        freqopt.profile("gpt3-small", layout="pp=2")
    # Training handles pipelines of freqopt's GPT-3 models without tensor parallelism (tests/test_pipeline_train.py).
    assert plan_training("gpt3-small", layout="dp=2,pp=2", seq_len=16).workload.layout == Layout(dp=2, pp=2)


@pytest.mark.parametrize("command", [["profile", "--model", "gpt3-small", "--layout", "tp=2,pp=2"]])
def test_the_cli_refuses_a_pipeline_in_one_line(command, capsys):
    code = main(command)
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1
    assert err.startswith("freqopt: error: --layout dp=1,tp=") and "does not handle pipelines" in err


def test_the_cli_lists_a_pipelines_parameters_per_gpu(capsys):
    assert main(["models", "gpt3-small", "--layout", "pp=4"]) == 0
    out = capsys.readouterr().out
    largest = max(stage_parameters(get_workload("gpt3-small").config, parse_layout("pp=4")))
    assert f"{largest / 1e6:,.1f} M (largest stage)" in out and "dp=1,tp=1,pp=4" in out


# -- against a real DeepSpeed pipeline engine ---------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["parameters", "uniform"])
def test_a_real_deepspeed_pipeline_holds_the_stages_freqopt_partitions(method, tmp_path):
    """Two CPU ranks (gloo) build DeepSpeed's PipelineModule from freqopt's layer list and train two 1F1B steps
    (tests/deepspeed_pipeline_rank.py); each rank's partition and parameters are freqopt's for that stage."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import deepspeed_pipeline_rank as rank_script
    from freqopt.workload.models.gpt3 import GPTConfig

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank", "--master_port",
           str(_free_port()), str(Path(__file__).with_name("deepspeed_pipeline_rank.py")), "--partition-method",
           method, "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = sorted((json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)), key=lambda r: r["stage"])
    config = GPTConfig(**rank_script.TINY)
    stages = partition_stages(build_model(config), 2, method)
    assert ranks[0]["parts"] == [stages[0].start, stages[1].start, stages[1].stop] == ranks[1]["parts"]
    assert [r["n_params"] for r in ranks] == stage_parameters(config, Layout(pp=2), method)
    assert ranks[0]["losses"] == ranks[1]["losses"] and all(0 < loss < 10 for loss in ranks[0]["losses"])
