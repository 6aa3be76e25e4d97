"""The canary: a handful of real requests through the full path before the shards start.

It uses the generation client and the audit code of the real run, so what it passes the run
will pass too. It fails fast, naming the reason and showing one offending sample, when the servers
do not think, answer nothing, or get cut off; and it estimates how long the whole run will take.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from regen.audit.dataset import audit_rows
from regen.audit.findings import AuditThresholds
from regen.config import RunConfig
from regen.coordination import end_approval_hold, hold_for_approval
from regen.errors import RegenError
from regen.generate import generate_rows
from regen.placement import servers_for
from regen.progress import RunProgress
from regen.quality import text_findings
from regen.prompts import Prompt, read_prompts
from regen.results import CanaryReport
from regen.servers.plan import against_plan, reported_under_use
from regen.toolcalls import written_call
from regen.turns import TOOL_DIVERGENCE, Conversation, steps
from regen.units import format_duration

log = logging.getLogger("regen.canary")

# More than this fraction of canary samples with a finding fails the run: a real thinking model
# may skip reasoning on the odd trivial prompt, never on a quarter of them.
MAX_BAD_FRACTION = 0.25


class CanaryFailed(RegenError):
    pass


@dataclass
class CanaryResult:
    rows: list[dict]
    problems: list[str] = field(default_factory=list)
    estimate: dict = field(default_factory=dict)


def first_prompts(path: str | Path, count: int) -> tuple[list[Prompt], int]:
    """The first ``count`` readable prompts, among them a multi-turn one and an agentic one when
    the file has any (the path of earlier steps' answers, and of the server's tool-call parser, is
    checked too), and how many prompts the file holds."""
    chosen: list[Prompt] = []
    kinds: dict[str, Prompt] = {}
    total = 0
    for item in read_prompts(path):
        if isinstance(item, Prompt):
            total += 1
            if len(chosen) < count:
                chosen.append(item)
            if "multi_turn" not in kinds and steps(item.messages) > 1:
                kinds["multi_turn"] = item
            if "agentic" not in kinds and item.agentic:
                kinds["agentic"] = item
    wanted: list[Prompt] = []  # one prompt may be both kinds
    for prompt in kinds.values():
        if prompt not in wanted:
            wanted.append(prompt)
    free = [i for i in reversed(range(len(chosen))) if chosen[i] not in wanted]
    for i, prompt in zip(free, [p for p in wanted if p not in chosen]):
        chosen[i] = prompt
    return chosen, total


WARM_UP_TOKENS = 8


def _rates(rows: list[dict]) -> list[tuple[float, float]]:
    """(tokens, tokens a second) of each good conversation, all its turns together."""
    out = []
    for r in rows:
        if r["error"] is None and r.get("completion_tokens"):
            tokens = sum(t["completion_tokens"] or 0 for t in r.get("turns") or []) or r["completion_tokens"]
            out.append((tokens, tokens / max(r["latency_s"], 1e-3)))
    return out


def estimate_run(alone: list[dict], together: list[dict], total_prompts: int, servers: int, slots: int,
                 queue_margin: int = 0) -> dict:
    """The run's time from two measurements: a request alone on its server (its decode speed
    r1) and several at once (rb with b running per server). A batching server slows each
    request as the batch fills, r(b) = r1 / (1 + k (b - 1)); k from the two, the run's rate is
    every decoding slot (the budget less the queue margin) at r(slots per server). One
    measurement only: r1 x slots, an upper bound."""
    first, second = _rates(alone), _rates(together)
    if not first and not second:
        return {}
    measured = first + second
    tokens = sum(t for t, _ in measured) / len(measured)
    r1 = sum(r for _, r in first) / len(first) if first else max(r for _, r in second)
    slowdown = 0.0
    batch = -(-len(together) // max(servers, 1))
    if first and second and batch > 1:
        rb = sum(r for _, r in second) / len(second)
        slowdown = max(0.0, (r1 / rb - 1) / (batch - 1))
    decoding = max(slots - servers * queue_margin, servers, 1)
    per_server = decoding / max(servers, 1)
    rate = decoding * r1 / (1 + slowdown * (per_server - 1))
    seconds = total_prompts * tokens / rate if rate > 0 else None
    return {"prompts": total_prompts, "tokens_per_sample": round(tokens, 1), "tokens_per_s": round(rate, 1),
            "alone_tokens_per_s": round(r1, 1), "batch_slowdown": round(slowdown, 4),
            "eta_s": round(seconds) if seconds else None,
            "text": f"{total_prompts:,} prompts, about {format_duration(seconds)} at {rate:,.0f} tok/s"}


def run_scope(cfg: RunConfig, file_total: int) -> tuple[int, int]:
    """The run's prompts (its index, once preflight wrote it: a trial's N, duplicates out) and the
    rows its shards have already written (a resumed or cleared run)."""
    from regen.files import read_json
    from regen.manifest import Manifest

    layout = cfg.layout
    count = ((Manifest(layout).read().get("prompts") or {}).get("count")
             if layout.prompt_index.exists() else None)
    done = (read_json(layout.progress_file) or {}).get("done", 0)
    total = count if count is not None else min(file_total, cfg.generation.limit or file_total)
    return total, min(done, total)


def run_cost(cfg: RunConfig, estimate: dict, total: int, done: int, servers: int) -> dict:
    """What the run will cost before it is approved: hours and GPU-hours (server-hours on a fleet
    without GPUs) for the rows still to come, and the share already done."""
    from regen.servers.gpus import GpuLayoutError, gpus_per_server, server_devices

    if not estimate:
        return {}
    try:
        on_gpus = cfg.engine != "sim" and any(server_devices(cfg))
    except GpuLayoutError:
        on_gpus = cfg.engine == "sglang"
    units = servers * gpus_per_server(cfg) if on_gpus else servers
    hours = estimate["eta_s"] / 3600 if estimate.get("eta_s") else None
    unit = "GPU-hours" if on_gpus else "server-hours"
    left = total - done
    if not left:
        return {"prompts_total": total, "done": done, "done_fraction": 1.0, "hours": 0.0, "devices": units,
                "device_unit": unit, "device_hours": 0.0, "text": f"all {total:,} prompts already done"}
    scope = f"{left:,} prompts" if not done else f"{left:,} of {total:,} prompts to go ({done / total:.0%} done)"
    cost = (f"; {units} {'GPU' if on_gpus else 'server'}{'s' if units != 1 else ''}: {hours * units:,.1f} {unit}"
            if hours is not None else "")
    return {"prompts_total": total, "done": done, "done_fraction": round(done / total, 4) if total else 0.0,
            "hours": round(hours, 3) if hours is not None else None, "devices": units, "device_unit": unit,
            "device_hours": round(hours * units, 2) if hours is not None else None,
            "text": f"{scope}, about {format_duration(estimate.get('eta_s'))} at "
                    f"{estimate['tokens_per_s']:,.0f} tok/s{cost}"}


def _tail(k: int, n: int, p: float) -> float:
    """P(at least k of n), each with probability p."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def calls_not_parsed(rows: list[dict], prompts: list[Prompt]) -> list[dict]:
    """Agentic rows whose last step came back without ``tool_calls`` where the model wrote a call:
    its text in the answer (no parser), or, where the dataset's step calls, an answer that stopped
    empty (SGLang drops a call that its parser, made for another call format, cannot read)."""
    recorded = {p.id: Conversation(p.id, p.messages) for p in prompts}
    out = []
    for row in rows:
        if row.get("tool_calls"):
            continue
        step = len(row.get("turns") or []) - (0 if row["error"] else 1)  # a refused step is not in turns
        dropped = (row["id"] in recorded and bool(recorded[row["id"]].recorded_calls(step))
                   and row["finish_reason"] == "stop" and not (row["content"] or "").strip())
        if dropped or written_call(row["content"], row["tools"]):
            out.append(row)
    return out


def run_canary(cfg: RunConfig, endpoints: list[tuple[str, str | None]]) -> CanaryResult:
    prompts, total = first_prompts(cfg.prompts, cfg.canary.size)
    if not prompts:
        raise CanaryFailed(f"prompts {cfg.prompts}: no readable prompt for the canary")
    quick = cfg.model_copy(update={"max_attempts": min(cfg.generation.max_attempts, 3)})
    # One prompt per server alone, then a full batch at once (the rest of the canary's prompts,
    # repeated to fill every decoding slot: on a batching server that costs about one request's
    # time): the batching curve's two ends. Every prompt's first answer is checked.
    servers = len(endpoints)
    # A server's first request pays one-time costs (template compilation, caches, graph capture on
    # a GPU): a short one per server first, unmeasured, so that "alone" measures decoding.
    generate_rows(quick.model_copy(update={"max_tokens": WARM_UP_TOKENS}), prompts[:servers], endpoints)
    alone, slots = generate_rows(quick, prompts[:servers], endpoints)
    rest = prompts[servers:] or prompts
    decoding = max(slots - servers * cfg.generation.queue_margin, len(rest))
    together, _ = generate_rows(quick, [rest[i % len(rest)] for i in range(decoding)], endpoints)
    rows, seen = list(alone), {r["id"] for r in alone}
    for row in together:
        if row["id"] not in seen:
            rows.append(row)
            seen.add(row["id"])
    summary, samples, results, thresholds = audit_rows(rows, cfg.model_path, AuditThresholds.from_config(cfg),
                                                       cfg.enable_thinking)
    result = CanaryResult(rows)
    n = len(samples)  # the samples training will see: one per assistant turn in the events layout
    for row, res in zip(samples, results):
        # A conversation stopped by a turn that hit max_tokens or looped holds that turn: named by
        # its cause (with the cause's advice), not as a failed request.
        if "earlier_turn_cut" not in res["findings"]:
            continue
        cause = [f for f in text_findings(row, cfg.enable_thinking) if f in ("truncated", "repetition_loop")]
        if cause:
            res["findings"] = [f for f in res["findings"] if f != "error"] + cause

    def check(finding: str, message: str, limit: float = MAX_BAD_FRACTION, plausible: float | None = None) -> None:
        """A problem when more than ``limit`` of the samples have the finding, or (``plausible``)
        when so many would be unlikely (under 1%) if the dataset's true fraction were that."""
        bad = [(row, res) for row, res in zip(samples, results) if finding in res["findings"]]
        if len(bad) / n > limit or (plausible is not None and bad and _tail(len(bad), n, plausible) < 0.01):
            row, res = bad[0]
            sample = {"id": row["id"], "loss_tokens": res["loss_tokens"],
                      "finish_reason": row["finish_reason"], "error": row["error"],
                      "reasoning_content": (row["reasoning_content"] or "")[:200] or None,
                      "content": (row["content"] or "")[:200]}
            result.problems.append(f"canary: {len(bad)} of {n} {message}; e.g. {json.dumps(sample)}")

    check("error", "requests failed", limit=0.0)
    if cfg.enable_thinking:
        check("missing_reasoning", "answers came back without reasoning while enable_thinking is "
              "on (is the server's reasoning parser set, or thinking disabled on the server?)")
    if not cfg.enable_thinking:
        check("thinking_mode_mismatch", "answers came back with reasoning while enable_thinking is off (the "
              "request's chat_template_kwargs did nothing: does the chat template read enable_thinking?)", limit=0.0)
    check("empty_answer", "answers are empty")
    check("repetition_loop", f"answers loop (reasoning or answer ends in a repeated span) above max_loop_fraction "
          f"{cfg.audit.max_loop_fraction:.0%}: decoding with temperature {cfg.sampling.temperature} and "
          f"presence_penalty {cfg.sampling.presence_penalty} loops; raise temperature (reasoning models' cards: "
          f"0.6, never greedy) or presence_penalty (up to 1.5) as the model's card recommends",
          limit=cfg.audit.max_loop_fraction)
    check("degenerate", f"samples are degenerate (loss mask under min_loss_tokens "
          f"{thresholds.min_loss_tokens}, or no reasoning while thinking is on): the audit's limit of "
          f"{cfg.audit.max_degenerate_fraction:.1%} would not hold", plausible=cfg.audit.max_degenerate_fraction)
    check("truncated", f"answers hit max_tokens {cfg.sampling.max_tokens} (above max_truncated_fraction "
          f"{cfg.canary.max_truncated_fraction:.0%}): {max_tokens_advice(rows, cfg.sampling.max_tokens)}",
          limit=cfg.canary.max_truncated_fraction)
    agentic = [r for r in rows if r.get("tools")]
    written = calls_not_parsed(agentic, prompts)
    if written:  # every such row ends at its first call: the run would keep nothing after it
        sample = {"id": written[0]["id"], "divergence": written[0].get("divergence"), "error": written[0]["error"],
                  "content": (written[0]["content"] or "")[:200]}
        result.problems.append(
            f"canary: {len(written)} of {len(agentic)} agentic conversations came back with no structured "
            f"tool_calls where the model wrote a call (its text in the answer, or an empty answer): the "
            f"servers' parser (tool_call_parser {cfg.engine_options.tool_call_parser!r}) does not read "
            f"this model's calls; set it to the one for its call format; e.g. {json.dumps(sample)}")
    at_first_step = [r for r in agentic if r not in written and (r.get("divergence") or "").startswith(FIRST_STEP)]
    if agentic and len(at_first_step) == len(agentic):  # not one conversation got past its first call
        sample = {"id": at_first_step[0]["id"], "divergence": at_first_step[0]["divergence"]}
        result.problems.append(
            f"canary: {len(at_first_step)} of {len(agentic)} agentic conversations ended at their first step: the "
            f"model called other tools than the recorded ones, so no recorded result could be spliced and the run "
            f"would keep one step of each (max_divergence_fraction {cfg.audit.max_divergence_fraction:.0%} would not "
            f"hold); check the model, its tools and tool_call_parser; e.g. {json.dumps(sample)}")
    total, done = run_scope(cfg, total)
    result.estimate = estimate_run(alone, together, total - done, len(endpoints), slots, cfg.generation.queue_margin)
    result.estimate.update(run_cost(cfg, result.estimate, total, done, len(endpoints)))
    check("off_policy", f"samples are not token for token what the engine was served and generated "
          f"(min_on_policy_fraction {thresholds.min_on_policy_fraction:.0%} would not hold; why: on_policy "
          f"{summary.on_policy['reasons']})", limit=1 - thresholds.min_on_policy_fraction)
    result.estimate["trainer_cut_fraction"] = round(summary.fraction("cut"), 4)  # preflight's estimate, measured
    result.estimate["train_max_length"] = thresholds.train_max_length
    sweep_s = cfg.canary.sweep_s if cfg.canary.sweep_s is not None else (0 if cfg.engine == "sim" else SWEEP_S)
    if sweep_s and not result.problems and not cfg.generation.concurrency_per_server:
        result.estimate["sweep"] = sweep_concurrency(quick, rest, endpoints, slots // servers, sweep_s)
    RunProgress(cfg.layout).write_section("canary", {
        "passed": not result.problems, "problems": result.problems, "samples": n,
        "estimate": result.estimate,
        "loss_tokens": sorted(r["loss_tokens"] for r in results),
    })
    return result


FIRST_STEP = f"{TOOL_DIVERGENCE}: step 0:"
SWEEP_S = 120.0  # the sweep's default budget on a GPU engine
SWEEP_TOKENS = 512  # each answer of the sweep is cut here: it measures rates, not answers
SWEEP_GAIN = 0.05  # fewer requests in flight are kept only when this much faster


def sweep_concurrency(cfg: RunConfig, prompts: list[Prompt], endpoints: list[tuple[str, str | None]],
                      slots_per_server: int, budget_s: float) -> dict:
    """Delivered tok/s with a quarter, half and all of each server's slots filled, within
    ``budget_s`` (a level is started only while time is left; answers are cut at SWEEP_TOKENS).
    A GPU can deliver more with fewer requests in flight (a hybrid model's state pool, KV cache
    pressure that preempts); ``best`` is the level the shards keep: the full one unless a lower
    one is SWEEP_GAIN faster."""
    levels = sorted({max(1, slots_per_server // 4), max(1, slots_per_server // 2), max(1, slots_per_server)})
    short = cfg.model_copy(update={"max_tokens": min(cfg.sampling.max_tokens, SWEEP_TOKENS)})
    measured, started = [], time.monotonic()
    for level in levels:
        if time.monotonic() - started >= budget_s:
            break
        batch = [prompts[i % len(prompts)] for i in range(level * len(endpoints))]
        began = time.monotonic()
        rows, _ = generate_rows(short.model_copy(update={"concurrency_per_server": level}), batch, endpoints)
        took = max(time.monotonic() - began, 1e-3)
        tokens = sum(t for t, _ in _rates(rows))
        measured.append({"concurrency_per_server": level, "tokens_per_s": round(tokens / took, 1),
                         "seconds": round(took, 2)})
    keep = level_to_keep(measured, levels[-1])
    log.info("canary sweep: %s; the shards keep %s", ", ".join(
        f"{m['concurrency_per_server']} per server {m['tokens_per_s']:,.0f} tok/s" for m in measured),
        f"{keep} per server" if keep else "every slot")
    return {"levels": measured, "best": keep}


def level_to_keep(measured: list[dict], every_slot: int) -> int | None:
    """The fastest level when it beats every slot filled by SWEEP_GAIN; None (every slot) when
    not, or when the sweep ran out of time before it measured every slot."""
    if not measured or measured[-1]["concurrency_per_server"] != every_slot:
        return None
    top, best = measured[-1], max(measured, key=lambda m: m["tokens_per_s"])
    faster = best is not top and best["tokens_per_s"] > top["tokens_per_s"] * (1 + SWEEP_GAIN)
    return best["concurrency_per_server"] if faster else None


def max_tokens_advice(rows: list[dict], max_tokens: int) -> str:
    """The value to raise max_tokens to, from the lengths the canary saw: twice the cut, and at
    least a quarter above the longest answer that finished, rounded up to 1,024."""
    finished = [r["completion_tokens"] for r in rows
                if r.get("finish_reason") == "stop" and isinstance(r.get("completion_tokens"), int)]
    longest = max(finished, default=0)
    value = -(-max(2 * max_tokens, int(longest * 1.25)) // 1024) * 1024
    seen = f"the longest answer that finished took {longest:,} tokens" if finished else "no answer finished"
    return f"raise max_tokens to at least {value:,} ({seen}; the model's traces are longer)"


EXAMPLE_CHARS = 600  # of each example's reasoning and answer, for a person approving the run


def canary(cfg: RunConfig, run_id: str | None = None) -> CanaryReport:
    """The canary stage, against the servers start_servers recorded (with ``run_id``, brought up
    here when they are gone, as a shard does)."""
    servers = servers_for(cfg, run_id)
    if cfg.canary.approve:  # a person decides after it: the servers wait, through the canary's checks too
        hold_for_approval(cfg.layout, run_id or "cli")
    result = run_canary(cfg, [(r.url, r.api_key) for r in servers])
    if result.problems:
        end_approval_hold(cfg.layout)
        raise CanaryFailed("\n".join(result.problems))
    off_plan = against_plan(cfg, servers[0])  # every server of a node is launched alike
    if off_plan:
        log.warning("%s", off_plan)
        result.estimate["off_plan"] = off_plan
    idle = reported_under_use(cfg, servers[0])
    if idle:
        log.warning("%s", idle)
        result.estimate["under_use"] = idle
    return CanaryReport(
        passed=True, samples=len(result.rows), estimate=result.estimate,
        examples=[{"id": r["id"], "turns": len(r.get("turns") or [1]),
                   "reasoning_content": (r["reasoning_content"] or "")[:EXAMPLE_CHARS],
                   "content": (r["content"] or "")[:EXAMPLE_CHARS]}
                  for r in sorted(result.rows, key=lambda r: r["id"])[:3]],  # the same three, however they finished
        summary=f"canary passed: {len(result.rows)} samples; estimate: {result.estimate.get('text', 'n/a')}"
                + (f"; the trainer cuts {cut:.0%} of its samples at train_max_length {result.estimate['train_max_length']:,}"
                   if (cut := result.estimate.get("trainer_cut_fraction")) else "")
                + (f"; {off_plan}" if off_plan else "") + (f"; {idle}" if idle else ""))
