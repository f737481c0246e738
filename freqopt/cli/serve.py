"""``freqopt serve-search``: per-phase GPU settings for LLM serving under latency targets (freqopt.search.serving)."""

from __future__ import annotations

import click

from freqopt.cli import check_json_path, check_names_first, cli, stdout_console, write_json


def _batch_sizes(value: str) -> list:
    """"8,64,256" -> [8, 64, 256]; a value that is not a whole number is passed on for the library to refuse."""
    out = []
    for part in value.split(","):
        part = part.strip()
        out.append(int(part) if part.isdigit() else part)
    return out


@cli.command("serve-search", short_help="Search prefill and decode settings for LLM serving.")
@click.option("--model", required=True, help="A decoder's Hugging Face config: hf:PATH (config.json or its folder).")
@click.option("--gpu", default="h100-sxm", show_default=True, help="GPU type (freqopt gpus), simulated under CUDA graphs.")
@click.option("--batch-sizes", default="8,64,256", show_default=True, help="Sequences decoding at once, comma-separated.")
@click.option("--prompt-len", default="1024", show_default=True,
              help="Tokens per prompt, or their distribution: tokens:weight pairs (256:3,1024:1) or @FILE of sampled "
                   "lengths, one a line.")
@click.option("--output-len", type=int, default=512, show_default=True, help="Tokens per answer.")
@click.option("--max-itl-slowdown", default="5%", show_default=True,
              help="Allowed inter-token latency against the default settings': 5% or 0.05.")
@click.option("--max-ttft-slowdown", default="10%", show_default=True,
              help="Allowed time to first token against the default settings': 10% or 0.1.")
@click.option("--tp", type=int, default=1, show_default=True, help="GPUs of the tensor-parallel group serving it.")
@click.option("--trials", "n_trials", type=int, default=16, show_default=True, help="Trials of each study.")
@click.option("--seed", type=int, default=0, show_default=True, help="The studies' and the simulated noise's seed.")
@click.option("--json", "json_path", default=None, help="Also write every row as JSON to this file.")
def serve_search(model, gpu, batch_sizes, prompt_len, output_len, max_itl_slowdown, max_ttft_slowdown, tp,
                 n_trials, seed, json_path) -> None:  # fmt: skip
    """Per batch size: the default settings' energy per output token, inter-token latency (ITL), time to first
    token (TTFT) and power, beside the least-energy prefill and decode settings within the targets and the one
    setting a unified batch (prefill and decode in the same steps) can hold, each checked without noise.

        freqopt serve-search --model hf:Qwen3-8B/config.json --batch-sizes 8,64,256 --max-itl-slowdown 5%
    """
    from freqopt.search.serving import serve_search as search

    check_names_first(gpu=gpu)
    check_json_path(json_path)
    result = search(model, batch_sizes=_batch_sizes(batch_sizes), prompt_len=prompt_len, output_len=output_len,
                    gpu=gpu, max_itl_slowdown=max_itl_slowdown, max_ttft_slowdown=max_ttft_slowdown,
                    n_trials=n_trials, seed=seed, tp=tp)  # fmt: skip
    _render(result)
    write_json(json_path, _doc(result))


def _label(setting) -> str:
    return setting.label()


def _render(result) -> None:
    from rich.table import Table

    group = f"{result.tp} x {result.gpu} (tensor parallel)" if result.tp > 1 else result.gpu
    lengths = result.prompt_lens
    prompts = (f"{lengths[0][0]}-{lengths[-1][0]} (mean {result.prompt_len})" if len(lengths) > 1
               else str(result.prompt_len))  # fmt: skip
    table = Table(title=f"{result.model} on {group}: prompts {prompts}, answers {result.output_len} tokens; ITL "
                        f"within {result.max_itl_slowdown:.0%}, TTFT within {result.max_ttft_slowdown:.0%}")
    for name, justify in (("batch", "right"), ("schedule", "left"), ("decode setting", "left"),
                          ("prefill setting", "left"), ("J / token", "right"), ("saved", "right"),
                          ("ITL ms", "right"), ("TTFT ms", "right"), ("decode W", "right")):  # fmt: skip
        table.add_column(name, justify=justify, no_wrap=True)
    for r in result.rows:
        default = r.energy_per_token_j("default")
        default_step = r.energy_per_token_j("default-step")
        per_phase = r.energy_per_token_j("per-phase")
        one = r.energy_per_token_j("one-setting")
        table.add_row(str(r.batch_size), "default, phases apart", "default", "default", f"{default:.4f}", "-",
                      f"{r.default_decode.time_s * 1e3:.2f}", f"{r.default_prefill.time_s * 1e3:.1f}",
                      f"{r.default_decode.power_w:.0f}")  # fmt: skip
        table.add_row("", "per phase" + ("" if r.per_phase_realizable else " (not realizable)"),
                      _label(r.decode.setting), _label(r.prefill.setting), f"{per_phase:.4f}",
                      f"{(1 - per_phase / default) * 100:.1f} %", f"{r.decode.time_s * 1e3:.2f}",
                      f"{r.prefill.time_s * 1e3:.1f}", f"{r.decode.power_w:.0f}")  # fmt: skip
        table.add_row("", "default, unified batch", "default", "default", f"{default_step:.4f}", "-",
                      f"{r.default_decode.time_s * 1e3:.2f}", "-", f"{r.default_decode.power_w:.0f}")  # fmt: skip
        table.add_row("", "one setting, unified batch", _label(r.one_setting.setting), _label(r.one_setting.setting),
                      f"{one:.4f}", f"{(1 - one / default_step) * 100:.1f} %",
                      f"{r.one_setting_decode.time_s * 1e3:.2f}", "-", f"{r.one_setting_decode.power_w:.0f}")  # fmt: skip
    console = stdout_console()
    console.print(table)
    console.print("phases apart: prefills and decode steps run apart (their own steps, or their own GPUs); per-phase "
                  "settings are realizable on one GPU where a prefill and the decode steps between two prompts each "
                  "outlast its switch latency. unified batch: prompts prefilled in the decode steps they join, one "
                  "setting for both; each saving is against the default of the same engine."
                  + (f" J / token: the {result.tp} GPUs'; decode W: one GPU's." if result.tp > 1 else "")
                  + (f" Prompts of {len(lengths)} lengths: TTFT and J / token are their mean, each setting within "
                     "its targets at every length." if len(lengths) > 1 else ""))


def _doc(result) -> dict:
    def choice(c):
        return {"setting": c.setting.label(), "time_s": c.time_s, "energy_j": c.energy_j, "time_rel": c.time_rel,
                "energy_rel": c.energy_rel, "n_measurements": c.n_measurements}  # fmt: skip

    return {"gpu": result.gpu, "tp": result.tp, "model": result.model, "prompt_len": result.prompt_len,
            "prompt_lens": [[tokens, p] for tokens, p in result.prompt_lens],
            "output_len": result.output_len, "max_itl_slowdown": result.max_itl_slowdown,
            "max_ttft_slowdown": result.max_ttft_slowdown,
            "rows": [{"batch_size": r.batch_size, "kv_len": r.kv_len, "per_phase_realizable": r.per_phase_realizable,
                      "energy_per_token_j": {w: r.energy_per_token_j(w) for w in
                                             ("default", "per-phase", "one-setting", "default-step")},
                      **{name: choice(getattr(r, name)) for name in
                         ("default_decode", "default_prefill", "default_step", "decode", "prefill", "one_setting",
                          "one_setting_decode")}} for r in result.rows]}  # fmt: skip
