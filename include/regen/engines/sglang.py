"""SGLang (production, GPU). Launch flags and `/server_info` as SGLang 0.5.23 has them."""

from __future__ import annotations

from pathlib import Path

from regen.config import RunConfig
from regen.engines.base import Engine, flag, parallel_flags

WITH_KEY = Path(__file__).with_name("with_key.py")


class SGLang(Engine):
    name = "sglang"
    needs_gpu = True
    version = "0.5.23"  # requirements-gpu.txt: the names below are this release's
    # Used only where the node has no SGLang to ask (preflight asks the installed one first).
    reasoning_parsers = frozenset({
        "apertus2509", "beam", "cohere_command4", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41",
        "dots", "gemma4", "gigachat35", "glm45", "gpt-oss", "granite_thinking_parser", "hunyuan", "inkling",
        "interns1", "iquest_q1", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "ling3", "mimo", "minimax",
        "minimax-append-think", "minimax-m3", "mistral", "muse", "nanbeige", "nemotron_3", "poolside_v1",
        "qwen3", "qwen3-thinking", "response_template", "step3", "step3p5"})
    tool_call_parsers = frozenset({
        "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4",
        "deepseekv41", "dots", "gemma4", "gigachat3", "gigachat35", "glm", "glm45", "glm47", "gpt-oss", "hermes",
        "hunyuan", "inkling", "interns1", "iquest_q1", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3",
        "llama3", "mimo", "minicpm5", "minimax-m2", "minimax-m3", "mistral", "muse", "nanbeige", "poolside_v1",
        "pythonic", "qwen", "qwen25", "qwen3_coder", "response_template", "spark25", "step3", "step3p5",
        "trinity"})
    run_flags = frozenset({
        "--mem-fraction-static", "--max-running-requests", "--max-total-tokens", "--max-prefill-tokens",
        "--chunked-prefill-size", "--context-length", "--schedule-policy", "--schedule-conservativeness",
        "--cuda-graph-max-bs-decode", "--cuda-graph-bs-decode", "--disable-cuda-graph", "--disable-radix-cache", "--enable-cache-report",
        "--enable-mixed-chunk", "--enable-dp-attention", "--attention-backend", "--sampling-backend",
        "--kv-cache-dtype", "--stream-interval", "--random-seed", "--log-level", "--watchdog-timeout",
        "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
        "--max-mamba-cache-size", "--mamba-ssm-dtype", "--mamba-full-memory-ratio"})
    info_paths = ("/server_info", "/get_server_info")
    metric_prefix = "sglang"
    metric_names = {"num_running_reqs": "running", "num_queue_reqs": "queued",
                    "gen_throughput": "gen_throughput", "spec_accept_length": "spec_accept_length"}
    request_fields = {"separate_reasoning": True, "return_prompt_token_ids": True, "return_token_ids": True}

    def token_ids(self, body: dict, choice: dict) -> tuple[list[int] | None, list[int] | None]:
        return choice.get("prompt_token_ids"), choice.get("response_token_ids")

    def module_argv(self, cfg: RunConfig) -> list[str]:
        return [self.python(cfg), "-m", "sglang.launch_server"]

    def launch_argv(self, cfg: RunConfig, model_path: str, port: int) -> list[str]:
        argv = self.module_argv(cfg)
        argv += ["--model-path", model_path, "--host", cfg.servers.host, "--port", str(port), "--enable-metrics"]
        argv += flag("--reasoning-parser", cfg.engine_options.reasoning_parser)
        argv += flag("--tool-call-parser", cfg.engine_options.tool_call_parser)
        argv += flag("--speculative-algorithm", cfg.engine_options.speculative_algorithm)
        argv += flag("--speculative-num-steps", cfg.engine_options.speculative_num_steps)
        argv += flag("--speculative-eagle-topk", cfg.engine_options.speculative_eagle_topk)
        argv += flag("--speculative-num-draft-tokens", cfg.engine_options.speculative_num_draft_tokens)
        argv += flag("--mem-fraction-static", cfg.engine_options.mem_fraction_static)
        argv += flag("--max-running-requests", cfg.engine_options.max_running_requests)
        argv += flag("--max-mamba-cache-size", cfg.engine_options.max_mamba_cache_size)
        argv += flag("--context-length", cfg.engine_options.context_length)
        argv += parallel_flags(cfg, "--tp-size", "--dp-size")
        argv += flag("--random-seed", cfg.sampling.seed)
        return argv + self.own_flags(cfg) + list(cfg.servers.extra_server_args)

    def server_argv(self, launch: list[str]) -> list[str]:
        """SGLang reads its key only from `--api-key`: regen's wrapper puts it there inside the
        process (regen.engines.with_key), from the environment."""
        python, dash_m, module, *args = launch
        assert dash_m == "-m", launch
        return [python, str(WITH_KEY), module, *args]

    def key_env(self, api_key: str) -> dict[str, str]:
        return {"REGEN_SERVER_API_KEY": api_key}

    def own_flags(self, cfg: RunConfig) -> list[str]:
        return []

    def effective_limit(self, info: dict, launch_limit: int | None) -> int | None:
        """Each data parallel rank runs up to its ``effective_max_running_requests_per_dp`` (lower
        than the launch value on hybrid Mamba models: SGLang issue 38846), and a server of
        ``dp_size`` ranks (one internal state each) that many times over. ``max_running_requests``
        beside it is only the launch value for the whole server, null when not given."""
        states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
        per_rank = [s["effective_max_running_requests_per_dp"] for s in states
                    if isinstance(s.get("effective_max_running_requests_per_dp"), int)
                    and s["effective_max_running_requests_per_dp"] > 0]
        ranks = max(len(states), info.get("dp_size") if isinstance(info.get("dp_size"), int) else 1, 1)
        values = [min(per_rank) * ranks] if per_rank else []
        if not values:
            launched = [v for v in [info.get("max_running_requests"), *(s.get("max_running_requests") for s in states)]
                        if isinstance(v, int) and v > 0]
            values += launched[:1]
        if launch_limit:
            values.append(launch_limit)
        return min(values) if values else None

    def served_model_path(self, info: dict) -> str | None:
        return info.get("model_path")
