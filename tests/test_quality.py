"""The live quality guard: rows judged as they come back with the audit's bounds, a server gone
bad drained (its run finishing on the others), a run gone bad stopped in generation; loops named
in the guard, the canary, the audit and the card."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from regen.quality import QualityFailed, over_bound, repetition_loop
from regen.servers.probe import free_port_base
from support.data import write_conversations, write_prompts
from support.engines import sim_requests_total

LOOP = "I will add the numbers. " + "Wait, let me re-check that step once more. " * 12


def test_a_loop_is_a_repeated_span_at_the_end_or_mostly_repeated_ngrams_and_prose_is_not():
    assert repetition_loop(LOOP)
    counted = " ".join(f"Check number {i % 3}: wait, let me re-check the sum of the first terms again." for i in range(40))
    assert repetition_loop(counted)  # a counter that changes: the 8-grams repeat
    prose = (Path(__file__).parent.parent / "README.md").read_text()[:6000]
    assert not repetition_loop(prose) and not repetition_loop("ab" * 50) and not repetition_loop(None)
    assert not over_bound(2, 100, 0.01) and over_bound(6, 100, 0.01)  # 1 allowed, 3 sigma and one more


def _shard(cfg, records, shard=0, **kwargs):
    from regen.dispatch import ClientTuning
    from regen.generate import ShardRun

    return ShardRun(cfg, [(r.url, r.api_key) for r in records], shard, records[0].model_fingerprint,
                    ClientTuning(progress_interval_s=0.2), **kwargs)


def test_a_server_that_stops_thinking_is_drained_and_the_run_finishes_on_the_other(sim_servers, tmp_path):
    """Two servers; the second stops thinking after its 60th request. It is drained at its fifth
    bad row (max_degenerate_fraction 0.01: 5 of a window of 100), at most 5 bad rows kept; its later bad
    answers are sent again to the first server, the shard completes and its audit passes; the
    run's marks name the server and why."""
    from regen.audit.dataset import audit
    from regen.status import attention

    base = free_port_base(2)
    cfg, records = sim_servers(num_servers=2, base_port=base, concurrency_per_server=4, num_shards=1,
                               prompts=str(write_prompts(tmp_path / "p.jsonl", 600)),
                               extra_server_args=["--sim-ignore-thinking-after", "60", "--sim-faults-on-port", str(base + 1)])
    bad = records[1]
    assert bad.port == base + 1
    result = _shard(cfg, records).run()
    assert (result.done, result.failed) == (600, 0)
    df = pd.read_parquet(Path(cfg.output) / "data")
    missing = df[df["reasoning_content"].fillna("") == ""]
    assert len(missing) <= 5 and set(missing["server"]) <= {bad.url}
    assert sim_requests_total(bad.url) <= 60 + 5 + 4  # onset, the bound, what was in flight
    quality = json.loads((Path(cfg.output) / "progress.json").read_text())["quality"]
    assert list(quality["drained"]) == [bad.url] and "degenerate in" in quality["drained"][bad.url]["why"]
    assert any(bad.url in d for item in attention(json.loads((Path(cfg.output) / "progress.json").read_text()),
                                                  None) for d in item["details"])
    assert audit(cfg).verdict == "PASS"


def test_a_run_whose_servers_all_go_bad_stops_in_generation_and_its_retries_send_nothing(sim_servers, tmp_path):
    """Both servers stop thinking after 30 requests: the shard fails with the guard's reason
    having sent under a fifth of its 600 requests; its retry fails at once, sending nothing."""
    cfg, records = sim_servers(num_servers=2, concurrency_per_server=4, num_shards=1,
                               prompts=str(write_prompts(tmp_path / "p.jsonl", 600)),
                               extra_server_args=["--sim-ignore-thinking-after", "30"])
    with pytest.raises(QualityFailed, match="quality guard: .*degenerate"):
        _shard(cfg, records).run()
    sent = sum(sim_requests_total(r.url) for r in records)
    assert sent < 600 / 5
    with pytest.raises(QualityFailed):
        _shard(cfg, records).run()
    assert sum(sim_requests_total(r.url) for r in records) == sent


def test_loops_are_counted_by_the_canary_the_audit_and_the_card_and_fail_the_canary(sim_servers, tmp_path):
    """The simulator loops on a tenth of its answers: the canary fails naming the sampling fields
    to change; the audit counts repetition_loop and fails above max_loop_fraction; the card says so."""
    from regen.audit.dataset import audit
    from regen.audit.findings import AuditFailed
    from regen.canary import CanaryFailed, canary

    cfg, records = sim_servers(num_servers=1, concurrency_per_server=8, num_shards=1, max_tokens=400,
                               prompts=str(write_prompts(tmp_path / "p.jsonl", 120)), canary_size=16,
                               extra_server_args=["--sim-loop-rate", "0.1"])
    with pytest.raises(CanaryFailed, match="answers loop .* raise temperature .* presence_penalty"):
        canary(cfg)
    # Three-turn conversations: most loops fill an earlier turn and stop the conversation there;
    # they are still named as loops, not as failed requests.
    talks = cfg.model_copy(update={"prompts": str(write_conversations(tmp_path / "c.jsonl", 40))})
    with pytest.raises(CanaryFailed, match="answers loop .* presence_penalty") as failed:
        canary(talks)
    assert "requests failed" not in str(failed.value)
    loose = cfg.model_copy(update={"audit": cfg.audit.model_copy(update={"max_loop_fraction": 0.5})})
    _shard(loose, records).run()
    with pytest.raises(AuditFailed):
        audit(cfg)
    summary = json.loads(cfg.layout.audit.summary_json.read_text())
    assert 0.03 < summary["counts"]["repetition_loop"] / summary["audited"] < 0.25
    assert any("above max_loop_fraction" in r for r in summary["reasons"])
    assert "repetition\\_loop" in (Path(cfg.output) / "README.md").read_text()


def test_every_row_says_what_made_it_and_a_dataset_of_two_templates_fails_naming_both(sim_servers, tmp_path):
    """Two servers of one shard, the second serving a copy of the model whose chat template was
    changed (a node with another image): every row records its engine, version, parsers, template
    and launch hashes; the audit fails the mix as foreign_settings naming both templates, the card
    lists both; allow_mixed_makers keeps them."""
    import shutil

    from regen.audit.dataset import audit
    from regen.audit.findings import AuditFailed
    from regen.chat.render import template_digest

    cfg, first = sim_servers(num_servers=1, num_shards=1, prompts=str(write_prompts(tmp_path / "p.jsonl", 60)))
    other = tmp_path / "other-image" / Path(cfg.model_path).name
    shutil.copytree(cfg.model_path, other)
    (other / "chat_template.jinja").write_text("{#- another image's template -#}\n" + (other / "chat_template.jinja").read_text())
    _, second = sim_servers(num_servers=1, model_path=str(other), output=str(tmp_path / "unused"))
    assert _shard(cfg, first + second).run().done == 60
    df = pd.read_parquet(Path(cfg.output) / "data")
    made = [json.loads(m) for m in df["made_by"]]
    assert all(m["engine"] and m["version"] and m["launch"] and m["chat_template"] for m in made)
    templates = {template_digest(cfg.model_path), template_digest(other)}
    assert {m["chat_template"] for m in made} == templates and len(templates) == 2
    with pytest.raises(AuditFailed):
        audit(cfg)
    summary = json.loads(cfg.layout.audit.summary_json.read_text())
    mixed = next(r for r in summary["reasons"] if r.startswith("rows made by different servers' setups"))
    assert all(t in mixed for t in templates) and summary["counts"]["foreign_settings"] > 0
    card = (Path(cfg.output) / "README.md").read_text()
    assert all(t in card for t in templates)
    allowed = cfg.model_copy(update={"audit": cfg.audit.model_copy(update={"allow_mixed_makers": True})})
    assert audit(allowed).verdict == "PASS"
