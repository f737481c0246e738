"""The serving search: per-phase GPU settings for LLM serving (prefill and decode), minimizing energy per output token
under latency targets relative to the default settings.

For each batch size B, on the simulated GPU (freqopt.workload.serving's kernels under CUDA graphs):

- **decode**: one study over the decode step of B sequences whose KV caches hold the prompt plus half the output
  (freqopt.search.study.search_unit: Optuna's GP on the SM and memory clocks, then one on the power limit),
  constrained to within ``max_itl_slowdown`` of the default step time; the choice is the least-energy measured
  setting within the target, checked without noise (the chosen setting's inter-token latency, ITL, within the
  target);
- **prefill**: the same over one prompt's prefill, its time the time to first token (TTFT), within
  ``max_ttft_slowdown``;
- **one setting**: the same over a continuous-batching engine's average step (its decode step with the prompts that
  join it, B / output_len per step: freqopt.workload.serving.step_kernels), within both targets: the schedule a
  single GPU running a unified batch can hold, since a switch (the GPU file's ``clock_switch_ms``: 26 ms on the
  H100) outlasts a decode step and prompts join steps every output_len / B steps.

Per-phase settings are realizable where prefill and decode run on separate GPUs (disaggregated serving), or on an
engine that runs prefills and decode steps apart, where a prefill and the run of decode steps between two prompts
each outlast the switch latency (``ServingRow.per_phase_realizable``); an engine that mixes them in one step (vLLM's
unified batch) can hold only the one setting. Energy per
output token: a decode step's energy over B, plus one prompt's prefill energy over the output_len tokens it yields.

Prompts of several lengths (``prompt_len`` a distribution: freqopt.workload.serving.prompt_length_distribution):
a decoding sequence's KV cache holds the mean prompt plus half the output (exact in expectation where attention
reads every cached key, as decode attention's cost is linear in the cache; an approximation for sliding-window
layers); the prefill phase and the average step run once per prompt length, their time and energy the expectation
over the distribution, and a setting meets a latency target only where it does at every length (the target is each
length's own default TTFT, or ITL, times 1 + the slowdown). The studies sample on the length that weighs most in the
default's expected energy; their measured settings are then checked at every length.

With tensor parallelism (``tp`` > 1: freqopt.workload.serving's ``ServingModel.sharded``, vLLM's Megatron-style
layers, each step's all-reduces over the GPU file's interconnect), every GPU of the group runs the same share of
each step at the same setting, so the search runs on one GPU's kernels and the energy per token is the group's: tp
times one GPU's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from freqopt.budget import parse_slowdown
from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.search.study import optuna_logging, search_unit
from freqopt.workload.serving import (cuda_graph_spec, prefill_kernels, prompt_length_distribution, serving_model,
                                      step_kernels)

__all__ = ["PhaseChoice", "ServingRow", "ServingResult", "serve_search"]


@dataclass(frozen=True)
class PhaseChoice:
    """A phase's setting and what it gives, noiseless: time_s (one step, or one prompt's prefill), energy_j, and
    their ratios to the default setting's; n_measurements the study took. Over a distribution of prompt lengths
    time_s, energy_j and energy_rel are expectations, and time_rel is the largest ratio at any one length (the one a
    latency target holds)."""

    setting: ClockSetting
    time_s: float
    energy_j: float
    time_rel: float
    energy_rel: float
    n_measurements: int

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s


@dataclass(frozen=True)
class ServingRow:
    """One batch size's default and chosen settings.

    Attributes:
        batch_size, kv_len: sequences decoding at once, and the KV cache each holds (the mean prompt + output /
            2).
        default_decode, default_prefill, default_step: the default setting's decode step, one prompt's prefill and
            the engine's average step (PhaseChoice with ratios 1).
        decode, prefill: the per-phase choices; one_setting: the single setting for the average step, and
            one_setting_decode: the decode step at that setting.
        prompts_per_step: the prompts whose prefill the average step carries (the rest of b / output_len steps
            are decode steps alone).
        per_phase_realizable: whether per-phase switching keeps up on one GPU whose engine runs prefills and
            decode steps apart: a prefill, and the run of decode steps between two prompts, each outlast the GPU's
            switch latency (or both phases chose one setting). A unified batch holds only one_setting.
        tp: the GPUs of the tensor-parallel group each step runs on; the PhaseChoice figures are one GPU's.
    """

    batch_size: int
    kv_len: int
    default_decode: PhaseChoice
    default_prefill: PhaseChoice
    default_step: PhaseChoice
    decode: PhaseChoice
    prefill: PhaseChoice
    one_setting: PhaseChoice
    one_setting_decode: PhaseChoice
    prompts_per_step: int
    output_len: int
    per_phase_realizable: bool
    tp: int = 1

    def energy_per_token_j(self, which: str = "per-phase") -> float:
        """Energy per output token, J: "default" and "per-phase" (a decode step over B, plus a prompt's prefill
        over the output_len tokens it yields), "one-setting" and "default-step" (a continuous-batching engine's
        expected step over B: the decode step, plus B / output_len prompts' share of the step that carries them);
        the tensor-parallel group's, tp GPUs."""
        b, o, n = self.batch_size, self.output_len, self.tp
        if which == "default":
            return n * (self.default_decode.energy_j / b + self.default_prefill.energy_j / o)
        if which == "per-phase":
            return n * (self.decode.energy_j / b + self.prefill.energy_j / o)
        if which in ("one-setting", "default-step"):
            decode, step = ((self.one_setting_decode, self.one_setting) if which == "one-setting"
                            else (self.default_decode, self.default_step))  # fmt: skip
            return n * (decode.energy_j + b / o / self.prompts_per_step * (step.energy_j - decode.energy_j)) / b
        raise InvalidSettingError(f"which must be default, per-phase, one-setting or default-step, not {which!r}",
                                  argument="which")  # fmt: skip


@dataclass(frozen=True)
class ServingResult:
    """What serve_search found: the GPU type's name, the model, the targets (fractions), a row per batch size and the
    tensor-parallel degree (tp GPUs a step). prompt_lens: ((tokens, probability), ...), the prompts' lengths;
    prompt_len: their mean, rounded to a token (the one length where all prompts have it)."""

    gpu: str
    model: str
    prompt_len: int
    output_len: int
    max_itl_slowdown: float
    max_ttft_slowdown: float
    rows: tuple[ServingRow, ...]
    tp: int = 1
    prompt_lens: tuple[tuple[int, float], ...] = ()


# A phase as it runs: (kernels, probability) per prompt length (one pair where every prompt has one length).
Variants = Sequence[tuple[list, float]]


def _choice(sim: SimulatedGPU, variants: Variants, setting: ClockSetting, defaults, n: int) -> PhaseChoice:
    """The phase at ``setting``: expected time and energy, the largest time ratio and the expected energy's ratio
    to ``defaults`` (the default setting's measurements, one a variant; None: this is the default)."""
    ms = [sim.true_measure(kernels, setting) for kernels, _ in variants]
    ds = defaults or ms
    time_s = sum(p * m.time_s for (_, p), m in zip(variants, ms))
    energy_j = sum(p * m.energy_j for (_, p), m in zip(variants, ms))
    default_energy_j = sum(p * d.energy_j for (_, p), d in zip(variants, ds))
    return PhaseChoice(setting, time_s, energy_j, max(m.time_s / d.time_s for m, d in zip(ms, ds)),
                       energy_j / default_energy_j, n)  # fmt: skip


def _defaults(sim: SimulatedGPU, variants: Variants) -> list:
    return [sim.true_measure(kernels, DEFAULT_SETTING) for kernels, _ in variants]


def _search_phase(sim: SimulatedGPU, variants: Variants, name: str, slowdown: float, *, n_trials: int, seed: int,
                  extra: Sequence[tuple] = ()) -> PhaseChoice:  # fmt: skip
    """The least-energy setting (expected over ``variants``) a clock study and a power-limit study found whose
    noiseless time is within ``slowdown`` of the default's at every variant (and which meets each (variants,
    slowdown) of ``extra`` too); the default where none is. The studies sample on the variant that weighs most in
    the default's expected energy."""
    defaults = _defaults(sim, variants)
    extra_defaults = [(v, s, _defaults(sim, v)) for v, s in extra]
    sampled = max(range(len(variants)), key=lambda i: variants[i][1] * defaults[i].energy_j)
    options, n = [], 0
    for space in ("clocks", "power"):
        found = search_unit(sim, variants[sampled][0], name=f"{name}-{space}", study_name=f"{name}-{space}",
                            storage=None, space=space, n_trials=n_trials, constrained=True, finalist_slowdown=slowdown,
                            seed=seed)  # fmt: skip
        options += [o.setting for o in found.options]
        n += found.n_measurements
    best = _choice(sim, variants, DEFAULT_SETTING, defaults, n)
    for setting in dict.fromkeys(options):
        c = _choice(sim, variants, setting, defaults, n)
        ok = c.time_rel <= 1.0 + slowdown and all(
            sim.true_measure(k, setting).time_s <= (1.0 + s) * d.time_s
            for v, s, ds in extra_defaults for (k, _), d in zip(v, ds))  # fmt: skip
        if ok and c.energy_j < best.energy_j:
            best = c
    return best


def serve_search(model: str, *, batch_sizes: Sequence[int] = (8, 64, 256),
                 prompt_len: int | str | Mapping[int, float] | Sequence[int] = 1024,
                 output_len: int = 512, gpu: str = "h100-sxm", max_itl_slowdown: float | str = "5%",
                 max_ttft_slowdown: float | str = "10%", n_trials: int = 16, seed: int = 0,
                 tp: int = 1) -> ServingResult:  # fmt: skip
    """Search per-phase settings (prefill, decode) and one setting for both, for serving ``model`` at each batch
    size, on the simulated GPU (module docstring: what is searched, checked and realizable).

    Args:
        model: a decoder's Hugging Face config, ``hf:PATH`` (freqopt.workload.serving.serving_model: dense, or
            routed experts with at most one shared expert).
        batch_sizes: sequences decoding at once, one row each.
        prompt_len: tokens per prompt, or a distribution of them (tokens -> weight, sampled lengths, or text:
            freqopt.workload.serving.prompt_length_distribution; module docstring).
        output_len: tokens per answer (the KV cache at decode: the mean prompt + output / 2).
        gpu: a GPU type (freqopt.gpu.specs.get_gpu), simulated without its host's per-kernel issue time (CUDA graphs).
        max_itl_slowdown, max_ttft_slowdown: the inter-token latency's and the time to first token's targets, as
            fractions or percentages of the default settings' (freqopt.budget.parse_slowdown).
        n_trials: trials of each study (a clock study and a power-limit study per phase).
        seed: the studies' seed and the simulated noise's.
        tp: GPUs of the tensor-parallel group serving the model (module docstring; default 1): the search runs on
            one GPU's share and the energy per token is the group's.

    Raises:
        InvalidSettingError: a bad target, size, prompt length distribution or batch size (its argument's name
            first); a model serving does
            not model (serving_model); a tp that is not a positive whole number or does not divide the model's
            query heads or MLP width (ServingModel.sharded). UnknownNameError: an unknown GPU type; transformers
            missing.
    """
    from freqopt.gpu.specs import get_gpu

    itl = parse_slowdown(max_itl_slowdown, argument="max_itl_slowdown")
    ttft = parse_slowdown(max_ttft_slowdown, argument="max_ttft_slowdown")
    batches = list(batch_sizes) if not isinstance(batch_sizes, (int, str)) else [batch_sizes]
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise InvalidSettingError(f"batch_sizes must be positive whole numbers, not {batch_sizes!r}",
                                  argument="batch_sizes")  # fmt: skip
    for what, value in (("output_len", output_len), ("n_trials", n_trials)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidSettingError(f"{what} must be a positive whole number, not {value!r}", argument=what)
    lengths = prompt_length_distribution(prompt_len)
    mean_prompt = sum(tokens * p for tokens, p in lengths)
    served = serving_model(model).sharded(tp)  # tp 1: the whole model, unchanged; a bad tp refused there
    spec = get_gpu(gpu)
    sim = SimulatedGPU(cuda_graph_spec(spec), seed=seed)
    kv_len = round(mean_prompt) + output_len // 2  # the mean prompt's cache, half an answer's tokens more
    prefill = [(prefill_kernels(served, tokens), p) for tokens, p in lengths]
    rows = []
    with optuna_logging():
        prefill_choice = _search_phase(sim, prefill, "prefill", ttft, n_trials=n_trials, seed=seed)
        default_prefill = _choice(sim, prefill, DEFAULT_SETTING, None, 0)
        shortest_prefill_s = min(m.time_s for m in _defaults(sim, prefill))
        for b in batches:
            decode = [(step_kernels(served, b, kv_len), 1.0)]
            default_decode = _choice(sim, decode, DEFAULT_SETTING, None, 0)
            decode_choice = _search_phase(sim, decode, f"decode-b{b}", itl, n_trials=n_trials, seed=seed)
            # The average step: the decode step with the share of a prompt that joins it, as whole prompts
            # (rounded up where fewer than one joins a step: one prompt every output_len / b steps), once per
            # prompt length.
            per_step = max(1, round(b / output_len))
            step = [(step_kernels(served, b, kv_len, prefill_tokens=per_step * tokens, prompt_len=tokens), p)
                    for tokens, p in lengths]  # fmt: skip
            default_step = _choice(sim, step, DEFAULT_SETTING, None, 0)
            one = _search_phase(sim, step, f"step-b{b}", itl, n_trials=n_trials, seed=seed,
                                extra=((decode, itl), (prefill, ttft)))  # fmt: skip
            switch_s = spec.clock_switch_s
            keeps_up = shortest_prefill_s >= switch_s and default_decode.time_s * output_len / b >= switch_s
            rows.append(ServingRow(
                batch_size=b, kv_len=kv_len, default_decode=default_decode, default_prefill=default_prefill,
                default_step=default_step, decode=decode_choice, prefill=prefill_choice, one_setting=one,
                one_setting_decode=_choice(sim, decode, one.setting, _defaults(sim, decode), 0),
                prompts_per_step=per_step,
                output_len=output_len,
                per_phase_realizable=decode_choice.setting == prefill_choice.setting or keeps_up, tp=served.tp,
            ))  # fmt: skip
    return ServingResult(gpu=spec.name, model=served.name, prompt_len=round(mean_prompt), output_len=output_len,
                         max_itl_slowdown=itl, max_ttft_slowdown=ttft, rows=tuple(rows), tp=served.tp,
                         prompt_lens=lengths)  # fmt: skip
