"""LLM serving workloads: the kernels of a prefill and of a decode step as a serving engine runs them.

A decode step of B sequences whose KV caches hold L tokens each, and a prefill of B prompts of P tokens, for a
decoder-only transformer given by its Hugging Face config (``hf:PATH``: Llama, Mistral, Qwen2 and Qwen3 families:
RMSNorm, grouped-query attention, rotary embeddings, a SwiGLU MLP; Qwen3-MoE and Mixtral, below). The kernels are those vLLM's model runner launches
per layer with its FlashAttention backend (vllm/model_executor/models/llama.py and qwen3.py, vllm/model_executor/
layers), built from the config rather than traced: vLLM does not run on the meta device, and the eager Hugging Face
modules that freqopt's tracer records launch other kernels (separate pow/mean/rsqrt/mul for a norm, a cache grown by
``torch.cat`` every step). Per layer:

1. ``fused_add_rms_norm`` (the residual add and the input norm, one kernel);
2. the fused q/k/v projection (one GEMM, QKVParallelLinear);
3. Qwen3's per-head q and k RMSNorm (``q_norm``, ``k_norm``), where the config's ``model_type`` is qwen3;
4. ``rotary_embedding`` on q and k;
5. ``reshape_and_cache_flash``: the new token's keys and values written into the paged cache;
6. attention: at decode, one query per sequence over its L cached keys, a memory-bound pass over the cache
   (``freqopt.decode_attention``: FlashAttention's split-KV decode reads every cached key and value once; its
   FLOPs, 4 B H L D, run far below the tensor cores' rate, so it is priced as a streaming reduction); at prefill,
   causal FlashAttention over the prompt (``freqopt.flash_attention``, the attention family of the GPU's file);
7. the output projection (RowParallelLinear); 8. ``fused_add_rms_norm``; 9. the fused gate/up projection
   (MergedColumnParallelLinear); 10. ``silu_and_mul``; 11. the down projection.

Then the final norm, the LM head over the last position of each sequence, and sampling (a softmax and argmax over
the vocabulary, in fp32). Weights and activations in bf16 (2 bytes), the KV cache in bf16. Under CUDA graphs (vLLM's
default for decode) the host issues a whole step at once, so a decode step's kernels run back to back: measure them
with ``cuda_graph_spec`` (the GPU type without its host's per-kernel issue time).

A mixture-of-experts layer (Qwen3-MoE, Mixtral: routed experts; Qwen2-MoE: routed experts and one shared expert)
runs, in place of the MLP, vLLM's router GEMM, its top-k softmax and its fused MoE kernels
(vllm/model_executor/layers/fused_moe: one grouped GEMM over the experts' gate/up projections, ``silu_and_mul``, one
over their down projections, and the weighted sum of each token's k outputs). The fused MoE kernels read the weights
of every expert some token of the step is routed to: with the tokens routed uniformly and independently (assumed: a
trained router balances its experts), an expert is touched by one of T tokens with probability 1 - (1 - k/E)^T, so
a decode step of 8 sequences on Qwen3-30B-A3B (E = 128 experts, k = 8) reads 52 experts' weights a layer, and one of
256 nearly all 128. A shared expert (Qwen2-MoE's ``shared_expert_intermediate_size``;
vllm/model_executor/models/qwen2_moe.py) is a SwiGLU MLP every token goes through, its weights read every step; its
sigmoid gate (a GEMM to one column) scales its output, which is then added to the routed experts' sum (a multiply
and an add); its kernels run after the routed experts', on the same stream.

Gemma 3 (``gemma3_text``): five of every six layers attend to a sliding window of the last ``sliding_window``
tokens (the config's ``layer_types``), so their decode attention reads at most that many cached keys (vLLM keeps
only the window for them), and every layer runs two more RMSNorms (Gemma's norms after attention and after the
MLP); its GeGLU ``gelu_and_mul`` moves the bytes SwiGLU's ``silu_and_mul`` does; its LM head is its embedding.

Tensor parallelism (``ServingModel.sharded(tp)``, vLLM's Megatron-style layers): each of the tp GPUs holds 1/tp
of the query heads, of the key/value heads (each GPU keeps one where there are fewer than tp: vLLM replicates
them), of the MLP's (or every expert's) intermediate size and of the vocabulary, and an all-reduce of the step's
hidden states (tokens x d_model in bf16) follows the output projection and the MLP. The kernels are one GPU's; the
group's energy is tp times theirs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path

from freqopt.errors import InvalidSettingError
from freqopt.workload.kernels import Kernel

__all__ = ["ServingModel", "serving_model", "decode_kernels", "prefill_kernels", "step_kernels", "cuda_graph_spec",
           "prompt_length_distribution", "BYTES"]

BYTES = 2  # bf16 weights, activations and KV cache
_DTYPE = "bfloat16"
_PASS = "forward"


@dataclasses.dataclass(frozen=True)
class ServingModel:
    """The sizes of a decoder a serving engine runs, dense or mixture-of-experts (from a Hugging Face config).

    Attributes:
        name: the model's name.
        n_layers, d_model: decoder layers and the hidden size.
        n_heads, n_kv_heads, head_dim: query heads, key/value heads (grouped-query attention) and their size.
        d_ff: the MLP's intermediate size (SwiGLU: gate and up projections of this width); for a
            mixture-of-experts model, each expert's.
        vocab_size: tokens of the vocabulary (the LM head's width).
        qk_norm: Qwen3's per-head RMSNorm on the queries and keys.
        n_experts, experts_per_token: a mixture-of-experts layer's routed experts and the k each token goes to (0:
            a dense MLP).
        shared_d_ff: the intermediate size of a mixture-of-experts layer's shared expert, with its sigmoid gate
            (Qwen2-MoE's; 0: none).
        window_layers, sliding_window: per layer, whether it attends to a sliding window, and the window in
            tokens (Gemma 3; empty: every layer attends to the whole sequence).
        sandwich_norms: two more RMSNorms a layer (Gemma's); tied_embeddings: the LM head is the embedding.
        tp: the tensor-parallel degree this model's sizes are one GPU's share of (``sharded``).
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    qk_norm: bool = False
    n_experts: int = 0
    experts_per_token: int = 0
    shared_d_ff: int = 0
    window_layers: tuple[bool, ...] = ()
    sliding_window: int = 0
    sandwich_norms: bool = False
    tied_embeddings: bool = False
    tp: int = 1

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def experts_touched(self, tokens: int) -> float:
        """Experts a step of ``tokens`` tokens routes at least one token to, expected under uniform independent
        routing: E (1 - (1 - k/E)^tokens) (module docstring)."""
        e, k = self.n_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    @property
    def n_params(self) -> int:
        """Weights, without norms: embeddings, LM head and every layer's projections."""
        qkv = self.d_model * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        mlp = 3 * self.d_model * self.d_ff * max(1, self.n_experts) + self.d_model * self.n_experts  # + router
        if self.shared_d_ff:
            mlp += 3 * self.d_model * self.shared_d_ff + self.d_model  # the shared expert and its gate
        layer = qkv + self.n_heads * self.head_dim * self.d_model + mlp
        return self.n_layers * layer + (1 if self.tied_embeddings else 2) * self.vocab_size * self.d_model

    def sharded(self, tp: int) -> ServingModel:
        """One GPU's share of the model under tensor parallelism of degree ``tp`` (module docstring).

        Raises:
            InvalidSettingError: tp not a positive whole number, or one that does not divide the query heads, the
                MLP's (or the shared expert's) intermediate size.
        """
        tp = _check("tp", tp)
        if self.tp != 1:
            raise InvalidSettingError(f"tp: {self.name} is sharded already (tp {self.tp})", argument="tp")
        for what, size in (("query heads", self.n_heads), ("the MLP's intermediate size", self.d_ff),
                           ("the shared expert's intermediate size", self.shared_d_ff)):  # fmt: skip
            if size % tp:
                raise InvalidSettingError(f"tp {tp} does not divide {what} of {self.name} ({size})", argument="tp")
        return dataclasses.replace(self, n_heads=self.n_heads // tp, n_kv_heads=max(1, self.n_kv_heads // tp),
                                   d_ff=self.d_ff // tp, shared_d_ff=self.shared_d_ff // tp,
                                   vocab_size=-(-self.vocab_size // tp), tp=tp)  # fmt: skip

    def keys(self, layer: int, length: int) -> int:
        """Keys layer ``layer`` attends to when a sequence holds ``length`` tokens: the sliding window's at most."""
        if self.window_layers and self.window_layers[layer]:
            return min(length, self.sliding_window)
        return length

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token holds over all layers (keys and values)."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * BYTES


def serving_model(model: str) -> ServingModel:
    """The ServingModel of ``model``, ``hf:PATH`` (a config.json or a folder holding one).

    Raises:
        InvalidSettingError: not an hf: config, an encoder config, a mixture-of-experts config with dense layers
            among its expert layers or with DeepSeek's latent attention and shared experts, or one without a
            decoder's sizes.
        UnknownNameError: transformers is missing (freqopt.workload.models.hf).
    """
    from freqopt.workload.models.hf import is_hf_model, load_hf_config

    if not is_hf_model(model):
        raise InvalidSettingError(f"model must be a Hugging Face config (hf:PATH) for serving workloads, not {model!r}",
                                  argument="model")  # fmt: skip
    config = load_hf_config(model)
    raw = json.loads(config.config_json)
    raw = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    if config.task != "causal-lm":
        raise InvalidSettingError(f"model {config.name} is not a decoder-only language model; serving needs one",
                                  argument="model")  # fmt: skip
    n_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if raw.get("n_routed_experts") or raw.get("n_shared_experts"):
        raise InvalidSettingError(f"model {config.name} is a DeepSeek-style mixture-of-experts model (latent "
                                  "attention, shared experts, dense first layers); serving workloads model routed "
                                  "experts in every layer, with one shared expert at most (Qwen3-MoE, Mixtral, "
                                  "Qwen2-MoE), and standard attention", argument="model")  # fmt: skip
    if n_experts and (raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1):
        raise InvalidSettingError(f"model {config.name} is a mixture-of-experts model with dense layers among its "
                                  "expert layers; serving workloads model routed experts in every layer (Qwen3-MoE, "
                                  "Mixtral, Qwen2-MoE)", argument="model")  # fmt: skip
    shared_d_ff = (raw.get("shared_expert_intermediate_size") or 0) if n_experts else 0
    if not isinstance(shared_d_ff, int) or shared_d_ff < 0:
        raise InvalidSettingError(f"model {config.name} gives shared_expert_intermediate_size {shared_d_ff!r}; it must "
                                  "be a whole number of units", argument="model")  # fmt: skip
    d_ff = raw.get("moe_intermediate_size") if n_experts and raw.get("moe_intermediate_size") else raw.get(
        "intermediate_size")  # fmt: skip
    if not isinstance(d_ff, int):
        raise InvalidSettingError(f"model {config.name} gives no intermediate_size; serving needs a SwiGLU decoder's sizes",
                                  argument="model")  # fmt: skip
    model_type = raw.get("model_type")
    types = raw.get("layer_types") or []
    window = int(raw.get("sliding_window") or 0)
    windows = tuple(kind == "sliding_attention" for kind in types) if window and len(types) == config.n_layers else ()
    return ServingModel(name=config.name, n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                        n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, d_ff=d_ff,
                        vocab_size=config.vocab_size, qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
                        n_experts=int(n_experts), experts_per_token=int(raw.get("num_experts_per_tok") or 0),
                        shared_d_ff=int(shared_d_ff),
                        window_layers=windows if any(windows) else (), sliding_window=window if any(windows) else 0,
                        sandwich_norms=model_type == "gemma3_text", tied_embeddings=config.tied_embeddings)  # fmt: skip


def _gemm(m: int, k: int, n: int) -> Kernel:
    """A bf16 GEMM (m, k) x (k, n): 2mkn FLOPs; reads both operands once, writes the output."""
    return Kernel(name="aten.mm", kind="gemm", pass_name=_PASS, flops=2.0 * m * k * n,
                  mem_bytes=float((m * k + k * n + m * n) * BYTES), dtype=_DTYPE, shapes=((m, k), (k, n)),
                  tensor_core=True)  # fmt: skip


def _stream(name: str, kind: str, nbytes: float, shape: tuple[int, ...], flops: float = 0.0) -> Kernel:
    return Kernel(name=name, kind=kind, pass_name=_PASS, flops=float(flops), mem_bytes=float(nbytes), dtype=_DTYPE,
                  shapes=(shape,))  # fmt: skip


def _check(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSettingError(f"{what} must be a positive whole number, not {value!r}", argument=what)
    return value


def _layers(m: ServingModel, tokens: int, attention: list[Kernel], new_kv_tokens: int) -> list[Kernel]:
    """One decoder layer's kernels over ``tokens`` rows, with the ``attention`` kernels in the middle."""
    d, hd = m.d_model, m.head_dim
    q_dim, kv_dim = m.n_heads * hd, m.n_kv_heads * hd
    norm_bytes = 4 * tokens * d * BYTES  # fused_add_rms_norm: reads x and the residual, writes both
    out = [_stream("vllm.fused_add_rms_norm", "normalization", norm_bytes, (tokens, d)),
           _gemm(tokens, d, q_dim + 2 * kv_dim)]
    if m.qk_norm:
        out.append(_stream("vllm.rms_norm", "normalization", 2 * tokens * (q_dim + kv_dim) * BYTES, (tokens, hd)))
    out += [_stream("vllm.rotary_embedding", "elementwise", 2 * tokens * (q_dim + kv_dim) * BYTES, (tokens, hd)),
            _stream("vllm.reshape_and_cache_flash", "memcpy", 2 * 2 * new_kv_tokens * kv_dim * BYTES,
                    (new_kv_tokens, kv_dim)),
            *attention,
            _gemm(tokens, q_dim, d),
            *_all_reduce(m, tokens),
            *([_stream("vllm.rms_norm", "normalization", 2 * tokens * d * BYTES, (tokens, d))] if m.sandwich_norms
              else []),
            _stream("vllm.fused_add_rms_norm", "normalization", norm_bytes, (tokens, d))]  # fmt: skip
    tail = [_stream("vllm.rms_norm", "normalization", 2 * tokens * d * BYTES, (tokens, d))] if m.sandwich_norms else []
    return out + (_moe(m, tokens) if m.is_moe else [
        _gemm(tokens, d, 2 * m.d_ff),
        _stream("vllm.silu_and_mul", "elementwise", 3 * tokens * m.d_ff * BYTES, (tokens, 2 * m.d_ff)),
        _gemm(tokens, m.d_ff, d)]) + _all_reduce(m, tokens) + tail


def _all_reduce(m: ServingModel, tokens: int) -> list[Kernel]:
    """The all-reduce of a tensor-parallel layer's output over its tp GPUs (none at tp 1): a ring of 2 (n - 1) / n
    of the hidden states' bytes each way (as freqopt.workload.trace's all-reduce kernel), on the compute stream."""
    n = m.tp
    if n == 1:
        return []
    nbytes = float(tokens * m.d_model * BYTES)
    return [Kernel(name="freqopt.all_reduce", kind="all-reduce", pass_name=_PASS, flops=tokens * m.d_model * (n - 1) / n,
                   mem_bytes=5 * (n - 1) / n * nbytes, dtype=_DTYPE, shapes=((tokens, m.d_model),), comm_bytes=nbytes,
                   group_size=n, group_stride=1)]  # fmt: skip


def _moe(m: ServingModel, tokens: int) -> list[Kernel]:
    """A mixture-of-experts layer over ``tokens`` tokens (module docstring): each grouped GEMM computes every
    token's k experts and reads the weights of the experts touched."""
    d, f, k = m.d_model, m.d_ff, m.experts_per_token
    rows = tokens * k  # token-expert pairs
    touched = m.experts_touched(tokens)

    def grouped(k_dim: int, n_dim: int) -> Kernel:
        nbytes = (rows * k_dim + touched * k_dim * n_dim + rows * n_dim) * BYTES
        return Kernel(name="vllm.fused_moe", kind="gemm", pass_name=_PASS, flops=2.0 * rows * k_dim * n_dim,
                      mem_bytes=float(nbytes), dtype=_DTYPE, shapes=((rows, k_dim), (k_dim, n_dim)),
                      tensor_core=True)  # fmt: skip

    routed = [_gemm(tokens, d, m.n_experts),
              _stream("vllm.topk_softmax", "softmax", tokens * m.n_experts * 4 + tokens * k * 8, (tokens, m.n_experts)),
              grouped(d, 2 * f),
              _stream("vllm.silu_and_mul", "elementwise", 3 * rows * f * BYTES, (rows, 2 * f)),
              grouped(f, d),
              _stream("vllm.moe_sum", "reduction", (rows * d + tokens * d) * BYTES, (tokens, k, d))]  # fmt: skip
    if not m.shared_d_ff:
        return routed
    g = m.shared_d_ff
    return routed + [_gemm(tokens, d, 2 * g),
                     _stream("vllm.silu_and_mul", "elementwise", 3 * tokens * g * BYTES, (tokens, 2 * g)),
                     _gemm(tokens, g, d),
                     _gemm(tokens, d, 1),  # the gate; its sigmoid (one value a token) is left out
                     _stream("aten.mul", "elementwise", 3 * tokens * d * BYTES, (tokens, d), flops=tokens * d),
                     _stream("aten.add", "elementwise", 3 * tokens * d * BYTES, (tokens, d), flops=tokens * d)]


def _head(m: ServingModel, sequences: int, tokens: int) -> list[Kernel]:
    """The embedding lookup is put first by the callers; here the final norm, the LM head on each sequence's last
    position and sampling over the vocabulary (fp32 logits: read once for the softmax, once for the argmax)."""
    return [_stream("vllm.rms_norm", "normalization", 2 * tokens * m.d_model * BYTES, (tokens, m.d_model)),
            _gemm(sequences, m.d_model, m.vocab_size),
            _stream("vllm.sampler", "reduction", 3 * sequences * m.vocab_size * 4, (sequences, m.vocab_size),
                    flops=5 * sequences * m.vocab_size)]  # fmt: skip


def _decode_attention(m: ServingModel, b: int, keys: int) -> Kernel:
    kv_bytes = 2 * b * keys * m.n_kv_heads * m.head_dim * BYTES
    q_bytes = 2 * b * m.n_heads * m.head_dim * BYTES  # the queries in, the output out
    return Kernel(name="freqopt.decode_attention", kind="reduction", pass_name=_PASS,
                  flops=4.0 * b * m.n_heads * keys * m.head_dim, mem_bytes=float(kv_bytes + q_bytes), dtype=_DTYPE,
                  shapes=((b, m.n_heads, 1, m.head_dim), (b, m.n_kv_heads, keys, m.head_dim)))  # fmt: skip


def _prefill_attention(m: ServingModel, sequences: int, queries: int, keys: int) -> Kernel:
    q = (sequences, m.n_heads, queries, m.head_dim)
    kv = (sequences, m.n_kv_heads, keys, m.head_dim)
    return Kernel(name="freqopt.flash_attention", kind="attention", pass_name=_PASS,
                  flops=4.0 * sequences * m.n_heads * queries * keys * m.head_dim,
                  mem_bytes=float(sequences * (2 * m.n_heads * queries + 2 * m.n_kv_heads * keys) * m.head_dim * BYTES),
                  dtype=_DTYPE, shapes=(q, kv, kv), tensor_core=True,
                  causal=keys >= queries)  # a window shorter than the prompt: each query attends a full window


def step_kernels(model: ServingModel, batch_size: int, kv_len: int, *, prefill_tokens: int = 0,
                 prompt_len: int | None = None) -> list[Kernel]:
    """The kernels of one step of a continuously batched engine (vLLM's unified batch): ``batch_size``
    sequences decoding one token each over KV caches of ``kv_len`` tokens, and ``prefill_tokens`` tokens of
    prompts (``prompt_len`` tokens each, default ``prefill_tokens``) prefilled in the same step: one GEMM per
    projection over all the step's tokens (the weights read once), decode attention for the decoding sequences
    and causal FlashAttention for the prompt tokens, which sample a first token only where a prompt completes
    (counted as prefill_tokens / prompt_len sequences at the LM head).

    Raises:
        InvalidSettingError: a size that is not a positive whole number (prefill_tokens may be 0, batch_size 0
            where prefill_tokens is not).
    """
    m = model
    c = prefill_tokens
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        raise InvalidSettingError(f"prefill_tokens must be a whole number >= 0, not {c!r}", argument="prefill_tokens")
    b = batch_size if (c and batch_size == 0) else _check("batch_size", batch_size)
    length = _check("kv_len", kv_len) if b else 0
    p = _check("prompt_len", prompt_len) if prompt_len is not None else max(c, 1)
    sequences = max(1, round(c / p)) if c else 0  # whole prompts where the chunk holds several
    completed = sequences

    def attention(layer: int) -> list[Kernel]:
        out = [_decode_attention(m, b, m.keys(layer, length + 1))] if b else []  # the new key joins the cache first
        if c:
            out.append(_prefill_attention(m, sequences, max(1, c // sequences), m.keys(layer, p)))
        return out

    tokens = b + c
    out = [_stream("aten.embedding", "embedding", 2 * tokens * m.d_model * BYTES, (tokens, m.d_model))]
    for layer in range(m.n_layers):
        out += _layers(m, tokens, attention(layer), tokens)
    return out + _head(m, b + completed, tokens)


def decode_kernels(model: ServingModel, batch_size: int, kv_len: int) -> list[Kernel]:
    """The kernels of one decode step: ``batch_size`` sequences, one new token each, every KV cache holding
    ``kv_len`` tokens before it (module docstring: the kernels and their sources).

    Raises:
        InvalidSettingError: a batch size or KV length that is not a positive whole number.
    """
    return step_kernels(model, _check("batch_size", batch_size), kv_len)


def prefill_kernels(model: ServingModel, prompt_len: int, batch_size: int = 1) -> list[Kernel]:
    """The kernels of one prefill: ``batch_size`` prompts of ``prompt_len`` tokens each, their KV caches written
    and the first output token sampled (causal FlashAttention over each prompt).

    Raises:
        InvalidSettingError: a prompt length or batch size that is not a positive whole number.
    """
    p, b = _check("prompt_len", prompt_len), _check("batch_size", batch_size)
    return step_kernels(model, 0, 1, prefill_tokens=b * p, prompt_len=p)


def cuda_graph_spec(spec):
    """``spec`` (a GPUSpec) without its host's per-kernel issue time: a step captured in a CUDA graph is launched
    whole, so its kernels run back to back (vLLM captures its decode steps so by default)."""
    return dataclasses.replace(spec, host_issue_s=0.0, host_gemm_issue_s=0.0)


def prompt_length_distribution(prompt_len) -> tuple[tuple[int, float], ...]:
    """Prompt lengths and their probabilities, ((tokens, probability), ...) sorted by tokens, probabilities summing
    to 1, from any of:

    - a whole number of tokens (every prompt that long): ``1024``;
    - a mapping of tokens to weights (any positive scale): ``{256: 3, 1024: 1}``;
    - a sequence of sampled lengths, each one prompt (a trace's, say): ``[212, 1530, 877]``;
    - text: ``"1024"``, ``"256:3,1024:1"`` (tokens:weight pairs) or ``"@PATH"``, a file of sampled lengths, one a
      line (blank lines and ``#`` comments skipped).

    Raises:
        InvalidSettingError (argument "prompt_len"): a length that is not a positive whole number, a weight that is
            not a positive finite number, no length at all, or a file that cannot be read.
    """
    def bad(why: str) -> InvalidSettingError:
        return InvalidSettingError(f"prompt_len {why}; give tokens (1024), tokens:weight pairs (256:3,1024:1) or "
                                   "@FILE of sampled lengths, one a line", argument="prompt_len")  # fmt: skip

    def length(value) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"has {value!r}, not a positive whole number of tokens")
        return value

    def weight(value) -> float:
        try:
            w = float(value)
        except (TypeError, ValueError):
            raise bad(f"has weight {value!r}, not a number") from None
        if isinstance(value, bool) or not math.isfinite(w) or w <= 0:
            raise bad(f"has weight {value!r}; weights must be positive")
        return w

    weights: dict[int, float] = {}

    def add(tokens, w: float) -> None:
        key = length(tokens)
        weights[key] = weights.get(key, 0.0) + w

    if isinstance(prompt_len, str):
        text = prompt_len.strip()
        if text.startswith("@"):
            try:
                lines = Path(text[1:]).read_text().splitlines()
            except (OSError, UnicodeDecodeError) as err:
                raise bad(f"file {text[1:]!r} cannot be read ({err.__class__.__name__})") from None
            prompt_len = [line for line in (raw.split("#", 1)[0].strip() for raw in lines) if line]
        elif ":" in text or "," in text:
            for part in text.split(","):
                tokens, sep, w = part.partition(":")
                add(tokens, weight(w) if sep else 1.0)
            prompt_len = ()
        else:
            prompt_len = length(text)
    if isinstance(prompt_len, Mapping):
        for tokens, w in prompt_len.items():
            add(tokens, weight(w))
    elif isinstance(prompt_len, (list, tuple)):
        for tokens in prompt_len:
            add(tokens, 1.0)
    else:
        add(prompt_len, 1.0)
    if not weights:
        raise bad("gives no length")
    total = sum(weights.values())
    return tuple((tokens, w / total) for tokens, w in sorted(weights.items()))
