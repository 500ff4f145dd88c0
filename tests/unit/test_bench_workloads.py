"""Workloads: deterministic given the seed, sharing prefixes exactly as their shapes promise."""
from __future__ import annotations

import json

import pytest

from bench.workloads import TextSource, WorkloadError, load_workload, unit_hashes

MOONCAKE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"


@pytest.mark.parametrize("name", ["system-prompt", "doc-qa", "multi-turn", "conversation"])
def test_generated_workloads_are_deterministic_given_the_seed(name):
    a = load_workload(name, seed=3, num_requests=200)
    b = load_workload(name, seed=3, num_requests=200)
    c = load_workload(name, seed=4, num_requests=200)
    assert a.requests == b.requests
    assert a.requests != c.requests
    assert len(a) == 200
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_system_prompt_requests_share_their_tenants_system_prompt_and_nothing_more():
    w = load_workload("system-prompt", seed=1, num_requests=300,
                      options=["tenants=5", "system_tokens=1024", "question_tokens=50-60"])
    text = TextSource(1)
    tenants = {r.segments[0][0] for r in w}
    assert len(tenants) == 5
    same = [r for r in w if r.segments[0] == w.requests[0].segments[0]]
    pa, pb = text.prompt(same[0]), text.prompt(same[1])
    assert len(pa) == same[0].prompt_tokens and 1074 <= len(pa) <= 1084
    common = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
    assert 1024 <= common < 1030  # the system prompt, plus at most a chance match of a few characters
    # Zipf: the most popular tenant gets more requests than the least popular one.
    counts = sorted((sum(1 for r in w if r.segments[0][0] == t) for t in tenants), reverse=True)
    assert counts[0] > 2 * counts[-1]


def test_doc_qa_interleaves_documents_and_asks_each_the_given_number_of_questions():
    w = load_workload("doc-qa", seed=0, num_requests=40, options={"documents": "4", "questions": "10"})
    docs = [r.segments[0][0] for r in w]
    assert len(set(docs)) == 4 and all(docs.count(d) == 10 for d in set(docs))
    assert len(set(docs[:4])) == 4  # the first round visits every document once


def test_multi_turn_history_grows_and_each_turn_extends_the_previous_one():
    w = load_workload("multi-turn", seed=2, num_requests=300)
    by_session: dict[str, list] = {}
    for r in w:
        by_session.setdefault(r.session, []).append(r)
    turns = max(by_session.values(), key=len)
    assert len(turns) >= 4
    for prev, nxt in zip(turns, turns[1:]):
        assert nxt.segments[:len(prev.segments)] == prev.segments
        assert len(nxt.segments) == len(prev.segments) + 2  # the answer, then the next question
        assert nxt.segments[len(prev.segments)][1] == prev.max_tokens
        assert nxt.arrival_s > prev.arrival_s


def test_conversation_turns_extend_the_previous_prompt_with_its_answer_and_share_only_the_first_block():
    w = load_workload("conversation", seed=1, num_requests=400)
    assert all(r.session is None for r in w)  # like a production trace: no session ids
    assert {r.segments[0] for r in w} == {w.requests[0].segments[0]} and w.requests[0].segments[0][1] == 512
    by_first = {}
    for r in w:
        by_first.setdefault(r.segments[1][0], []).append(r)
    turns = max(by_first.values(), key=len)
    assert len(turns) >= 3
    for prev, nxt in zip(turns, turns[1:]):
        assert nxt.segments[:len(prev.segments)] == prev.segments
        assert nxt.segments[len(prev.segments)][1] == prev.max_tokens  # the previous answer, then a message
        assert nxt.arrival_s >= prev.arrival_s + 5.0  # the answer streams and is read first
    # Two different conversations share exactly the first 512-token block.
    a, b = (v[0] for v in list(by_first.values())[:2])
    assert unit_hashes(a.segments, 512)[0] == unit_hashes(b.segments, 512)[0]
    assert unit_hashes(a.segments, 512)[1:2] != unit_hashes(b.segments, 512)[1:2]


def test_conversation_defaults_look_like_the_production_trace_the_issue_describes():
    w = load_workload("conversation", seed=0, num_requests=3000)
    lengths = sorted(r.prompt_tokens for r in w)
    assert 10_000 < sum(lengths) / len(lengths) < 14_500 and 5_000 < lengths[1500] < 9_000
    assert 50_000 < lengths[int(0.99 * len(lengths))] < 120_000
    seen, reused, total = set(), 0, 0
    for r in w:
        for h in unit_hashes(r.segments, 512):
            reused += h in seen
            seen.add(h)
            total += 1
    assert 0.28 < reused / total < 0.45  # about a third of the blocks are reusable with one infinite cache
    assert 2.5 < len(w) / w.requests[-1].arrival_s < 4.5  # a few requests per second


def test_mooncake_blocks_become_512_token_segments_with_the_exact_input_length():
    w = load_workload(f"mooncake:{MOONCAKE}", num_requests=50)
    with open(MOONCAKE) as fh:
        rows = [json.loads(next(fh)) for _ in range(50)]
    first = rows[0]
    r = w.requests[0]
    assert r.prompt_tokens == first["input_length"] == 40160
    assert [cid for cid, _ in r.segments] == first["hash_ids"]
    assert r.segments[-1][1] == 40160 - 512 * 78
    assert r.max_tokens == first["output_length"]
    assert r.arrival_s == 0.0
    # Same hash id, same text: the prompts of requests sharing ids share a byte-identical prefix.
    text = TextSource(0)
    assert text.text(46, 512)[:100] == text.text(46, 100)
    assert len(text.prompt(r)) == 40160


def test_mooncake_hit_rate_with_one_infinite_cache_matches_the_trace_readme():
    w = load_workload(f"mooncake:{MOONCAKE}")
    seen_ids: set[int] = set()
    seen_blocks: set[int] = set()
    id_hits = ids = block_hits = blocks = 0
    for r in w:
        chain = [cid for cid, _ in r.segments]
        ids += len(chain)
        id_hits += next((i for i, c in enumerate(chain) if c not in seen_ids), len(chain))
        seen_ids.update(chain)
        hashes = unit_hashes(r.segments, 512)
        blocks += len(hashes)
        block_hits += next((i for i, h in enumerate(hashes) if h not in seen_blocks), len(hashes))
        seen_blocks.update(hashes)
    assert round(id_hits / ids, 3) == 0.640  # the README's figure, counted in hash ids
    # Counted over full 512-token blocks only (a partial last block is never cached, and it is
    # usually a request's own tail), the same hits make a larger share.
    assert (block_hits, blocks) == (77740, 117888)


def test_azure_replay_has_arrivals_and_lengths_but_no_sharing():
    w = load_workload("azure:/work/shared/traces/AzureLLMInferenceTrace_code.csv", num_requests=100)
    assert w.requests[0].prompt_tokens == 4808 and w.requests[0].max_tokens == 10
    assert w.requests[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert len({r.segments[0][0] for r in w}) == 100


def test_unit_hashes_name_exactly_the_shared_full_blocks():
    a = ((1, 100), (2, 50))
    b = ((1, 100), (3, 50))
    c = ((1, 60), (4, 90))
    ha, hb, hc = (unit_hashes(x, 64) for x in (a, b, c))
    assert len(ha) == 2  # 150 tokens: two full 64-token blocks, the partial third has no hash
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]  # tokens 100..127 differ
    assert hc[0] != ha[0]  # block 0 of c holds 60 tokens of id 1 then 4 of id 4


def test_bad_workload_names_and_options_are_clear_errors():
    with pytest.raises(WorkloadError, match="unknown workload"):
        load_workload("nope")
    with pytest.raises(WorkloadError, match="unknown workload option"):
        load_workload("doc-qa", options=["colour=red"])
    with pytest.raises(WorkloadError, match="needs a file"):
        load_workload("mooncake")
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload("mooncake:/nonexistent.jsonl")


def test_rate_replaces_arrivals_by_a_deterministic_poisson_process_and_keeps_the_prompts():
    from bench.workloads.base import retime_poisson

    base = load_workload(f"mooncake:{MOONCAKE}", num_requests=500)
    a = retime_poisson(load_workload(f"mooncake:{MOONCAKE}", num_requests=500), 5.0, seed=1)
    b = retime_poisson(load_workload(f"mooncake:{MOONCAKE}", num_requests=500), 5.0, seed=1)
    assert [r.segments for r in a] == [r.segments for r in base]
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert a.requests[-1].arrival_s / 499 == pytest.approx(1 / 5.0, rel=0.15)  # mean gap ~ 1/rate
