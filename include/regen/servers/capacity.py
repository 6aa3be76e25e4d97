"""The operating point of one SGLang server: how many requests it can run, and what limits that.

A hybrid model (Qwen3.5/3.6: Gated-DeltaNet layers beside full attention) keeps a fixed-size
state per request next to its KV cache, and SGLang sizes both pools at launch from what the
weights leave of the GPU's static fraction. The seed's servers ran about 7 requests each against
a cap near 16, and nobody could see the cap before the GPUs were paid for. This follows SGLang
0.5.23's own sizing step by step: ``memory_hook.handle_gpu_memory_settings`` (the static
fraction), ``KVCacheConfigurator._handle_max_mamba_cache`` (the state pool) and
``resolve_max_num_reqs`` (the cap); tests run those functions on the same inputs. The CUDA
context is an estimate; after launch ``/server_info`` has the real figures and the canary
compares them with this plan (:func:`compare`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from regen.files import MAX_JSON_BYTES, read_bounded
from regen.modelconfig import context_length, text_config

MIB, GIB = 1 << 20, 1 << 30
# Total memory as nvidia-smi reports it (MiB).
GPU_MEMORY_MIB = {"A100-80GB": 81_920, "H100": 81_559, "H200": 143_771, "B200": 183_359}
CUDA_CONTEXT_MIB = 1_024  # CUDA context, NCCL and allocator before the weights: an estimate
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# SGLang's state slots per running request on a hybrid model: 3, plus 2 tracking slots when the
# radix cache keeps its extra buffer (the default with the overlap scheduler); 1 without radix cache.
STATE_SLOTS_BASE, STATE_SLOTS_EXTRA_BUFFER = 3, 2
MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's default share of state memory to KV memory
SPECULATIVE_DEFAULT_CAP = 48  # SGLang's max_running_requests under speculative decoding when not given
FAR_OFF = 2.0  # a reported limit this many times away from the plan is worth a sentence
# SGLang 0.5.23's hybrid configs (sglang/srt/configs/qwen3_next.py, qwen3_5.py): their model types,
# the Gated-DeltaNet defaults of Qwen3NextConfig, which Qwen3.5/3.6's text config inherits, and the
# vision tower's hidden size by default (Qwen3VLVisionConfig).
HYBRID_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
HYBRID_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32}
VISION_HIDDEN_DEFAULT = 1152


@dataclass(frozen=True)
class LaunchFlags:
    """The launch flags that move the operating point, as the server will be started."""

    tp_size: int = 1
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_mamba_cache_size: int | None = None
    speculative_num_draft_tokens: int | None = None
    context_length: int | None = None
    mamba_ssm_dtype: str | None = None
    mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None
    kv_cache_dtype: str | None = None
    language_only: bool = False

    @classmethod
    def of(cls, cfg) -> "LaunchFlags":
        """The flags of a run's config, its extra server arguments included."""
        o = cfg.engine_options
        extra = list(cfg.servers.extra_server_args)

        def value(name: str) -> str | None:
            for i, arg in enumerate(extra):
                if arg == name and i + 1 < len(extra):
                    return extra[i + 1]
                if arg.startswith(name + "="):
                    return arg.split("=", 1)[1]
            return None

        chunked = value("--chunked-prefill-size")
        return cls(tp_size=o.tp_size, mem_fraction_static=o.mem_fraction_static,
                   max_running_requests=o.max_running_requests, max_mamba_cache_size=o.max_mamba_cache_size,
                   speculative_num_draft_tokens=(o.speculative_num_draft_tokens if o.speculative_algorithm
                                                 else None),
                   context_length=o.context_length, mamba_ssm_dtype=value("--mamba-ssm-dtype"),
                   mamba_full_memory_ratio=float(value("--mamba-full-memory-ratio") or MAMBA_FULL_MEMORY_RATIO),
                   disable_radix_cache="--disable-radix-cache" in extra,
                   chunked_prefill_size=int(chunked) if chunked else None,
                   kv_cache_dtype=value("--kv-cache-dtype"), language_only="--language-only" in extra)


@dataclass(frozen=True)
class ModelShape:
    """What of a model's config.json sizes its memory."""

    full_attention_layers: int
    linear_attention_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    context_length: int
    weight_bytes: int
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    mamba_ssm_dtype: str | None = None
    draft_layers: int = 0  # MTP layers, served with their own KV beside the model's
    vision_layers: int = 0
    vision_hidden: int = 0

    @classmethod
    def of(cls, model_dir: str | Path) -> "ModelShape":
        """The shape as SGLang 0.5.23 reads it: a hybrid model's absent fields take its config
        class's defaults; a config it could not load, or a folder without weights, is refused
        (ValueError naming what is missing) rather than planned on zeros."""
        model_dir = Path(model_dir)
        config = json.loads(read_bounded(model_dir / "config.json", MAX_JSON_BYTES))
        text, vision = text_config(config), config.get("vision_config") or {}
        layers = int(text["num_hidden_layers"])
        kinds = text.get("layer_types")
        hybrid = {text.get("model_type"), config.get("model_type")} & HYBRID_MODEL_TYPES
        if hybrid:
            # SGLang's Qwen3NextConfig types its layers by full_attention_interval alone, which has no default.
            if not text.get("full_attention_interval"):
                raise ValueError(f"{model_dir / 'config.json'}: a {sorted(hybrid)[0]} config without "
                                 "full_attention_interval, which SGLang 0.5.23 cannot load (its Qwen3NextConfig has "
                                 "no default for it)")
            text = {**HYBRID_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
            kinds = None
        if not kinds and text.get("full_attention_interval"):
            kinds = ["full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
                     for i in range(layers)]
        linear = sum(1 for k in kinds or [] if k == "linear_attention")
        heads = int(text["num_attention_heads"])
        return cls(full_attention_layers=layers - linear, linear_attention_layers=linear,
                   kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
                   dtype=str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"),
                   context_length=context_length(config) or 2048, weight_bytes=weight_bytes(model_dir),
                   linear_key_heads=int(text.get("linear_num_key_heads") or 0),
                   linear_value_heads=int(text.get("linear_num_value_heads") or 0),
                   linear_key_head_dim=int(text.get("linear_key_head_dim") or 0),
                   linear_value_head_dim=int(text.get("linear_value_head_dim") or 0),
                   linear_conv_kernel=int(text.get("linear_conv_kernel_dim") or 0),
                   mamba_ssm_dtype=text.get("mamba_ssm_dtype"),
                   draft_layers=int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0),
                   # SGLang reads num_hidden_layers, which Qwen's vision configs do not have (they say
                   # depth): it takes its default 24, and so does this; hidden_size defaults as its class's.
                   vision_layers=int(vision.get("num_hidden_layers") or 24) if vision else 0,
                   vision_hidden=int(vision.get("hidden_size") or VISION_HIDDEN_DEFAULT) if vision else 0)

    def state_bytes_per_request(self, tp_size: int, ssm_dtype: str | None) -> int:
        """One request's Gated-DeltaNet state on one GPU: a conv window over q, k and v plus the
        recurrent matrix per value head, over every linear layer (SGLang's Mamba2StateShape)."""
        if not self.linear_attention_layers:
            return 0
        groups = self.linear_key_heads
        if groups % tp_size:  # SGLang replicates key heads so each shard holds whole groups
            groups += tp_size - groups
        conv = (self.linear_value_heads * self.linear_value_head_dim + 2 * groups * self.linear_key_head_dim
                ) // tp_size * (self.linear_conv_kernel - 1) * 2  # the conv state stays bfloat16
        temporal = (self.linear_value_heads // tp_size) * self.linear_value_head_dim * self.linear_key_head_dim
        dtype = ssm_dtype or self.mamba_ssm_dtype or "float32"
        return (conv + temporal * DTYPE_BYTES[dtype]) * self.linear_attention_layers

    def kv_bytes_per_token(self, tp_size: int, kv_dtype: str | None, with_draft: bool) -> int:
        layers = self.full_attention_layers + (self.draft_layers if with_draft else 0)
        heads = max(1, self.kv_heads // tp_size)
        return layers * 2 * heads * self.head_dim * DTYPE_BYTES.get(kv_dtype or self.dtype, 2)


def weight_bytes(model_dir: Path) -> int:
    """The checkpoint's size: the index's ``total_size`` when it ships one, else its files; a
    folder with neither is refused (a plan on 0 GiB of weights promised three times the requests)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        total = (json.loads(read_bounded(index, MAX_JSON_BYTES)).get("metadata") or {}).get("total_size")
        if isinstance(total, int) and total > 0:
            return total
    files = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no weights to size (no *.safetensors, no model.safetensors.index.json "
                         "with metadata.total_size)")
    return files


def gpu_memory_mib(gpu: str) -> int:
    """A GPU by name (H200, B200 ...) or by its memory in MiB."""
    if gpu.isdigit():
        return int(gpu)
    for name, mib in GPU_MEMORY_MIB.items():
        if gpu.upper().replace(" ", "") in (name.upper(), name.upper().split("-")[0]):
            return mib
    raise ValueError(f"unknown GPU {gpu!r}: name one of {', '.join(GPU_MEMORY_MIB)} or give its memory in MiB")


def prefill_graph_sizes(max_tokens: int) -> int:
    """How many prefill CUDA graphs SGLang captures up to ``max_tokens`` (its capture buckets:
    steps of 4 to 32, 16 to 256, 32 to 512, 64 to 1024, 256 to 4096, then 512)."""
    steps = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256), (4608, max_tokens, 512))
    return sum(len(range(low, min(high, max_tokens) + 1, step)) for low, high, step in steps)


def graph_reserve_mib(decode_graph_bs: int, prefill_chunk: int) -> float:
    """SGLang's reserve for CUDA graphs (``reserve_for_graph_mb``; CUDA captures prefill too by
    default): 2 MiB per decode batch slot and 8 MiB per prefill graph, the chunk its largest."""
    return decode_graph_bs * 2 + prefill_graph_sizes(prefill_chunk) * 8


def graph_sizes(gpu_mib: int, flags: LaunchFlags) -> tuple[int, int]:
    """SGLang's prefill chunk and decode CUDA-graph batch for this GPU, as the flags leave them."""
    if gpu_mib < 60 * 1024:
        chunk, graph_bs = 4096, 32 if flags.tp_size < 4 else 160
    elif gpu_mib < 160 * 1024:
        chunk, graph_bs = 8192, 256 if flags.tp_size < 4 else 512
    else:
        chunk, graph_bs = 16384, 512
    chunk = flags.chunked_prefill_size or chunk
    if flags.max_running_requests and flags.max_running_requests < graph_bs:
        graph_bs = flags.max_running_requests
    return chunk, graph_bs


def static_fraction(gpu_mib: int, shape: ModelShape, flags: LaunchFlags) -> float:
    """SGLang's default ``--mem-fraction-static`` for this GPU: room for activations (1.5 MiB per
    prefill chunk token), the CUDA graphs and a parallel slack, at least 10 GiB on a GPU over
    60 GiB; less again for a vision-language model's encoder."""
    if flags.mem_fraction_static:
        return flags.mem_fraction_static
    chunk, graph_bs = graph_sizes(gpu_mib, flags)
    reserved = 512 + max(chunk, 2048) * 1.5 + flags.tp_size / 8 * 1024 + graph_reserve_mib(graph_bs, chunk)
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_mib - reserved) / gpu_mib, 3)
    if shape.vision_layers and not flags.language_only:
        complexity = shape.vision_layers * shape.vision_hidden ** 2 / (24 * 1024 ** 2)
        fraction *= 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (complexity - 1.0)))
    return fraction


@dataclass
class OperatingPoint:
    """One server's plan: the pools, the cap and what binds it, with the flags that raise it."""

    gpu_mib: int
    static_fraction: float
    weights_gib: float
    pools_gib: float  # what the static fraction leaves the KV cache and the request state
    state_mib_per_request: float
    state_slots_per_request: int
    state_slots: int | None
    kv_kib_per_token: float
    kv_tokens: int
    max_running_requests: int
    limited_by: str
    requests_in_kv: int | None = None
    raise_with: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """A few lines a person reads before launching."""
        out = [f"GPU {self.gpu_mib / 1024:.0f} GiB, static fraction {self.static_fraction:.3f}, "
               f"weights {self.weights_gib:.1f} GiB per GPU, {self.pools_gib:.1f} GiB left for the caches",
               f"KV cache {self.kv_kib_per_token:.0f} KiB per token: {self.kv_tokens:,} tokens"
               + (f" (about {self.requests_in_kv} requests at max_tokens each)" if self.requests_in_kv else "")]
        if self.state_slots is not None:
            out.append(f"request state {self.state_mib_per_request:.0f} MiB per slot, "
                       f"{self.state_slots_per_request} slots per request: {self.state_slots} slots")
        out.append(f"runs up to {self.max_running_requests} requests per server, limited by {self.limited_by}")
        if self.raise_with:
            out.append("to run more: " + "; ".join(self.raise_with))
        return out


def plan(shape: ModelShape, gpu_mib: int, flags: LaunchFlags, tokens_per_request: int | None = None
         ) -> OperatingPoint:
    """What SGLang will size at launch, from the model's shape and the GPU's memory."""
    tp, context, draft = flags.tp_size, flags.context_length or shape.context_length, flags.speculative_num_draft_tokens
    if draft and not flags.max_running_requests:
        flags = replace(flags, max_running_requests=SPECULATIVE_DEFAULT_CAP)
    fraction = static_fraction(gpu_mib, shape, flags)
    before_weights = (gpu_mib - CUDA_CONTEXT_MIB) * MIB
    weights = shape.weight_bytes / tp
    rest = (before_weights - weights) - before_weights * (1 - fraction)
    if rest <= 0:
        raise ValueError(f"the weights ({weights / GIB:.1f} GiB per GPU) leave no memory for the KV cache at "
                         f"static fraction {fraction:.3f}: raise tp_size or mem_fraction_static")
    per_request = shape.state_bytes_per_request(tp, flags.mamba_ssm_dtype)
    slots_per_request = 1 if flags.disable_radix_cache else STATE_SLOTS_BASE + STATE_SLOTS_EXTRA_BUFFER
    state_slots, pools = None, rest
    if per_request:
        if flags.max_mamba_cache_size:
            state_slots = flags.max_mamba_cache_size
            if draft:
                capped = min(max(1, flags.max_running_requests or 1), state_slots // slots_per_request)
                rest -= per_request * (capped + 1) * draft
        elif flags.disable_radix_cache and flags.max_running_requests:
            state_slots = flags.max_running_requests
            if draft:
                rest -= per_request * (state_slots + 1) * draft
        else:
            budget = rest * flags.mamba_full_memory_ratio / (1 + flags.mamba_full_memory_ratio)
            if draft:
                state_slots = int((budget - per_request * (1 + draft)) // (per_request * (1 + draft / slots_per_request)))
                capped = min(max(1, flags.max_running_requests or 1), state_slots // slots_per_request)
                rest -= per_request * (capped + 1) * draft
            else:
                state_slots = int((budget - per_request) // per_request)
        if state_slots <= 0:
            raise ValueError(f"no GPU memory for the hybrid model's request state ({per_request / MIB:.0f} MiB "
                             "per slot): raise tp_size or mem_fraction_static")
        rest -= (state_slots + 1) * per_request
    cell = shape.kv_bytes_per_token(tp, flags.kv_cache_dtype, with_draft=bool(draft))
    tokens = int(rest // cell)
    default = max(min(int(tokens / context * 512), 4096), 2048)
    limits = {"SGLang's default cap" if not flags.max_running_requests else "max_running_requests":
              flags.max_running_requests or default, "the KV cache (2 tokens per request)": tokens // 2}
    if state_slots is not None:
        limits["the request state pool"] = state_slots // slots_per_request
    limited_by = min(limits, key=limits.get)
    point = OperatingPoint(
        gpu_mib=gpu_mib, static_fraction=fraction, weights_gib=weights / GIB, pools_gib=pools / GIB,
        state_mib_per_request=per_request / MIB, state_slots_per_request=slots_per_request,
        state_slots=state_slots, kv_kib_per_token=cell / 1024, kv_tokens=tokens,
        max_running_requests=limits[limited_by], limited_by=limited_by,
        requests_in_kv=tokens // tokens_per_request if tokens_per_request else None)
    if limited_by == "the request state pool":
        if (flags.mamba_ssm_dtype or shape.mamba_ssm_dtype or "float32") == "float32":
            point.raise_with.append("--mamba-ssm-dtype bfloat16 (halves the recurrent state)")
        if not flags.disable_radix_cache:
            point.raise_with.append("--disable-radix-cache for single-turn data (1 state slot per request, not "
                                    f"{slots_per_request})")
        point.raise_with.append("--mamba-full-memory-ratio above "
                                f"{flags.mamba_full_memory_ratio} or --max-mamba-cache-size N (fewer KV tokens)")
    if limited_by.startswith("the KV cache") or (point.requests_in_kv or 1 << 30) < point.max_running_requests:
        point.raise_with.append("--kv-cache-dtype fp8_e4m3, a larger tp_size, or mem_fraction_static")
    return point


def plan_for(cfg, model_dir: str | Path, gpu: str, tokens_per_request: int | None = None) -> OperatingPoint:
    """The plan of a run's servers on a named GPU, from the model directory."""
    return plan(ModelShape.of(model_dir), gpu_memory_mib(gpu), LaunchFlags.of(cfg), tokens_per_request)


def compare(planned: dict[str, Any], token_capacity: int | None, effective: int | None) -> str | None:
    """A sentence when a launched server's own figures (``/server_info``: its KV token capacity and
    the requests it runs) are far from the plan, None when close: the plan's inputs, and what the
    run was budgeted on, are then off."""
    notes = []
    if isinstance(token_capacity, int) and token_capacity > 0:
        if not 1 / FAR_OFF <= token_capacity / max(planned["kv_tokens"], 1) <= FAR_OFF:
            notes.append(f"its KV cache holds {token_capacity:,} tokens, the plan {planned['kv_tokens']:,}")
    if effective and not 1 / FAR_OFF <= effective / max(planned["max_running_requests"], 1) <= FAR_OFF:
        notes.append(f"it runs up to {effective} requests, the plan {planned['max_running_requests']} "
                     f"({planned['limited_by']})")
    return "; ".join(notes) or None


def under_use(concurrency: int | None, can_run: int | None, whose: str = "the plan") -> str | None:
    """A sentence when the run sends a server less than half of what it can run at once (the seed
    sent 7 per server to servers that could run 16), with the value to set; None otherwise."""
    if not concurrency or not can_run or concurrency * 2 >= can_run:
        return None
    return (f"concurrency_per_server {concurrency} keeps {concurrency} of the {can_run} requests a server can run "
            f"busy ({concurrency / can_run:.0%}, {whose}): set concurrency_per_server: {can_run}, or leave it "
            f"empty to follow each server's own limit")
