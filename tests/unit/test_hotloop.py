"""The compiled inner loops (router/routing/_hotloop.c) decide exactly as the Python loops do.

Each scenario drives two Balancers through the same random history -- decisions acted on, first
bytes, finishes with usage, load reports, KV events (GPU and CPU tier), workers leaving and coming back, excluded
workers, every policy, affinities from 0 to 1, candidate limits that force the index's
depth-on-demand lookup -- one with the C loops and one with ``hotloop.hot`` set to None, and
compares every decision (worker, reason, predicted cached tokens, cost and every candidate's
cost, to the bit) and every candidate set.
"""
from __future__ import annotations

import importlib.util
import math
import os
import random
import shutil
import sysconfig

import pytest

from protocol import KVEvent, LoadReport
from router.routing import hotloop
from router.routing import load as board_module
from router.routing.balancer import Balancer
from router.routing.load import LoadBoard, SpeedProfile
from router.routing.policies import get_policy
from router.routing.policy import Candidate, NoCapacity, PolicyConfig, RouteRequest
from router.routing.prompt import prompt_key
from tests.support import run_isolated

C_LOOPS = hotloop.hot
needs_c = pytest.mark.skipif(C_LOOPS is None, reason="the C loops are not built (no compiler, or PREFIXLB_PURE_PYTHON)")

DOCS = ["".join(f"Document {d}, clause {i}: the tenant shall keep the premises in good repair. " for i in range(60))
        for d in range(6)]


def test_the_c_loops_are_built_wherever_a_compiler_is():
    """`make install` builds them (setup.py); a silent fallback would lose the speed unnoticed."""
    if os.environ.get(hotloop.PURE_PYTHON_ENV, "") not in ("", "0"):
        pytest.skip("PREFIXLB_PURE_PYTHON is set")
    if not shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"):
        pytest.skip("no C compiler here: the Python loops are the build")
    assert C_LOOPS is not None
    assert C_LOOPS.LAYOUT_VERSION == hotloop.LAYOUT_VERSION


def test_pure_python_env_turns_them_off(monkeypatch):
    monkeypatch.setenv(hotloop.PURE_PYTHON_ENV, "1")
    assert hotloop.load() is None
    monkeypatch.setenv(hotloop.PURE_PYTHON_ENV, "0")
    # built or not, whatever this run's own environment said when the module was imported
    assert (hotloop.load() is not None) == (importlib.util.find_spec("router.routing._hotloop") is not None)


def _history(seed: int, pure: bool, monkeypatch) -> list[tuple]:
    """One random history (see the module docstring); returns what every decision said."""
    monkeypatch.setattr(hotloop, "hot", None if pure else C_LOOPS)
    monkeypatch.setattr(board_module, "_refresh", board_module.refresh_python if pure else C_LOOPS.refresh)
    rng = random.Random(seed)
    policy = rng.choice(["cache_aware", "cache_aware", "cache_aware", "least_load", "consistent_hash"])
    affinity = rng.choice([0.0, 0.2, 0.5, 0.8, 0.9, 1.0])
    config = PolicyConfig(policy=policy, affinity=affinity, match_candidates=rng.choice([1, 2, 8]),
                          ring_candidates=rng.choice([1, 3]), load_candidates=rng.choice([0, 2]),
                          tie_tolerance=rng.choice([0.0, 0.05, 0.5]), tie_floor_s=rng.choice([0.0, 0.001, 1]))
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=rng.choice([800.0, 5000.0]), decode_step_s=0.02))
    b = Balancer(config, chunk_size=128, board=board, tokens_per_byte=rng.choice([0.25, 1.0]),
                 feedback_clear_after=2)
    workers = [f"w{i}" for i in range(rng.randint(1, 14))]
    for w in workers:
        b.add_worker(w, block_size=rng.choice([1, 16, 32]), max_num_seqs=rng.choice([None, 2, 64]))
    seqs = dict.fromkeys(workers, 0)
    tiered = rng.random() < 0.3  # CPU KV tiers: the candidate set's Python loop, choose's C loop
    live: list = []
    out: list[tuple] = []
    now = 0.0
    for step in range(160):
        now += rng.choice([0.0, 0.001, 0.05, 0.4])
        roll = rng.random()
        if roll < 0.55:
            doc = rng.choice(DOCS)
            text = doc[:rng.randint(1, len(doc))] + ("" if rng.random() < 0.3 else f" question {rng.random()}")
            session = f"user-{rng.randint(0, 5)}" if rng.random() < 0.2 else None
            p = prompt_key({"model": rng.choice(["tiny", "big"]), "prompt": text}, chat=False, chunk_size=128,
                           ring_key_chunks=8, session_key=session)
            exclude = set(rng.sample(workers, rng.randint(0, min(2, len(workers))))) if rng.random() < 0.2 else set()
            try:
                d = b.decide(p, now, affinity=rng.choice([None, None, 0.0, 0.7, 1.0]), exclude=exclude)
            except NoCapacity as e:
                out.append(("no capacity", str(e), e.candidates))
                continue
            out.append((d.worker_id, d.reason, d.predicted_cached_tokens, d.cost_s.hex() if d.cost_s else d.cost_s,
                        tuple((w, c.hex()) for w, c in d.costs), d.prompt_tokens, d.matched_chunks))
            live.append(b.dispatch(d, p, now))
        elif roll < 0.7 and live:
            booking = live.pop(rng.randrange(len(live)))
            b.first_byte(booking, now)
            tokens = booking.decision.prompt_tokens + rng.randint(-20, 40)
            b.finish(booking, now, usage=(max(1, tokens), rng.choice([None, 0, booking.decision.predicted_cached_tokens,
                                                                     rng.randint(0, 400)])))
        elif roll < 0.82:
            w = rng.choice(workers)
            b.apply_report(LoadReport(worker_id=w, running=rng.randint(0, 8), waiting=rng.randint(0, 4),
                                      queued_prefill_tokens=rng.randint(0, 5000),
                                      running_tokens=rng.randint(0, 9000),
                                      capacity_tokens=rng.choice([0, 4096, 100000]),
                                      max_num_seqs=rng.choice([0, 4, 64]),
                                      prefill_tokens_per_s=rng.choice([0.0, 900.0, 12000.5]),
                                      decode_step_s=rng.choice([0.0, 0.015]),
                                      kv_tier_load_tokens_per_s=rng.choice([0.0, 2000.0, 1e6]), ts=now), now)
        elif roll < 0.92:
            w = rng.choice(workers)
            seqs[w] += 1
            doc = rng.choice(DOCS)
            p = prompt_key({"model": "tiny", "prompt": doc[:rng.randint(200, len(doc))]}, chat=False,
                           chunk_size=128, ring_key_chunks=8)
            kind = rng.choice(["stored", "stored", "removed", "cleared"])
            b.apply_kv_event(KVEvent(worker_id=w, kind=kind, hashes=[] if kind == "cleared" else p.hashes,
                                     chunk_size=128, seq=seqs[w], ts=now,
                                     medium=rng.choice(["gpu", "gpu", "cpu"]) if tiered else "gpu"), now)
        else:
            w = rng.choice(workers)
            b.set_routable(w, rng.random() < 0.6)
    return out


@needs_c
@pytest.mark.parametrize("seed", range(60))
def test_random_histories_decide_the_same_with_and_without_the_c_loops(seed, monkeypatch):
    compiled = _history(seed, pure=False, monkeypatch=monkeypatch)
    python = _history(seed, pure=True, monkeypatch=monkeypatch)
    assert compiled == python
    assert any(d[0] != "no capacity" for d in compiled)


@needs_c
def test_the_candidate_sets_are_equal_field_for_field(monkeypatch):
    rng = random.Random(7)
    b = Balancer(PolicyConfig(match_candidates=2), chunk_size=128, tokens_per_byte=0.3)
    for i in range(30):
        b.add_worker(f"w{i}", block_size=rng.choice([1, 16]))
    prompts = [prompt_key({"model": "m", "prompt": d[:rng.randint(500, len(d))]}, chat=False, chunk_size=128,
                          ring_key_chunks=8) for d in DOCS * 4]
    for p in prompts[:10]:
        for w in rng.sample(range(30), 5):  # many holders: the index answers a depth lookup
            b.index.insert(p.hashes[:rng.randint(1, len(p.hashes))], f"w{w}", 0.0, confirmed=True)
    for p in prompts:
        matches, complete = b.index.match_top(p.hashes, 0.1, 2)
        if not complete:
            from router.routing.balancer import _DepthLookup
            matches = _DepthLookup(matches, b.index, p.hashes, 0.1)
        monkeypatch.setattr(hotloop, "hot", C_LOOPS)
        compiled = b.candidate_set(p, matches, 900, 0.1, frozenset(), b.config)
        monkeypatch.setattr(hotloop, "hot", None)
        python = b.candidate_set(p, matches, 900, 0.1, frozenset(), b.config)
        assert compiled == python
        assert [type(getattr(c, f)) for c in compiled for f in Candidate.__slots__] == \
            [type(getattr(c, f)) for c in python for f in Candidate.__slots__]


def _candidates(**overrides) -> list[Candidate]:
    base = [Candidate(worker_id="a", tokens_per_s=1000.0, cached_tokens=512, pending_s=0.2, in_system=1,
                      ring_rank=1, service_s=1.0),
            Candidate(worker_id="b", tokens_per_s=1200.0, cached_tokens=0, pending_s=0.0, ring_rank=0, service_s=1.0),
            Candidate(worker_id="c", tokens_per_s=900.0, cached_tokens=128, pending_s=0.05, service_s=1.0)]
    for name, value in overrides.items():
        setattr(base[0], name, value)
    return base


@needs_c
@pytest.mark.parametrize("overrides", [
    {"tokens_per_s": 1000},            # an int rate: Python's int arithmetic, not the C loop's
    {"pending_s": 1},
    {"cached_tokens": 2 ** 60},        # past 2**53
    {"cached_tokens": True},
    {"over_limit": 1},
    {"in_system": 3.0},
])
def test_values_the_c_loop_was_not_written_for_get_pythons_answer(overrides, monkeypatch):
    request = RouteRequest(prompt_tokens=2048, load_bound=2)
    policy = get_policy("cache_aware")
    assert C_LOOPS.choose(_candidates(**overrides), 4, 2048, 2, 16.0, 1.0, 4096.0, 0.001, 0.05) is NotImplemented
    monkeypatch.setattr(hotloop, "hot", C_LOOPS)
    compiled = policy.choose(request, _candidates(**overrides), PolicyConfig())
    monkeypatch.setattr(hotloop, "hot", None)
    assert compiled == policy.choose(request, _candidates(**overrides), PolicyConfig())


@needs_c
def test_a_zero_rate_raises_as_python_does_and_no_capacity_is_no_capacity(monkeypatch):
    policy = get_policy("cache_aware")
    request = RouteRequest(prompt_tokens=100, load_bound=1)
    for hot in (C_LOOPS, None):
        monkeypatch.setattr(hotloop, "hot", hot)
        with pytest.raises(ZeroDivisionError):
            policy.choose(request, _candidates(tokens_per_s=0.0), PolicyConfig())
        full = _candidates()
        for c in full:
            c.over_limit = True
        with pytest.raises(NoCapacity, match="in-flight limit"):
            policy.choose(request, full, PolicyConfig())
        with pytest.raises(NoCapacity, match="no workers"):
            policy.choose(request, [], PolicyConfig())


@needs_c
def test_following_the_cache_and_exact_costs(monkeypatch):
    """a = 1 with a unique longest match: only its holder competes; costs match bit for bit."""
    policy = get_policy("cache_aware")
    request = RouteRequest(prompt_tokens=4096, load_bound=3)
    results = []
    for hot in (C_LOOPS, None):
        monkeypatch.setattr(hotloop, "hot", hot)
        for affinity in (0.0, 0.5, 1.0):
            d = policy.choose(request, _candidates(pending_s=50.0), PolicyConfig(affinity=affinity))
            results.append((d.worker_id, d.reason, d.cost_s.hex(), [(w, c.hex()) for w, c in d.costs]))
    assert results[:3] == results[3:]
    assert results[2][0] == "a" and results[0][0] != "a"  # a=1 follows the cache past 50 s of backlog
    assert all(math.isfinite(float.fromhex(c)) for _, c in results[2][3])


@needs_c
def test_an_unknown_worker_leaves_it_to_python():
    """Python's loop raises its KeyError for a worker the board does not track; the C loop defers."""
    assert C_LOOPS.candidates(["x"], [], {}, False, {}, {}, 1.0, 10, 0.0) is NotImplemented
    assert C_LOOPS.candidates([], [], {}, False, {}, {}, 1.0, 10, 0.0) == []


@needs_c
def test_ring_walks_agree_for_any_key_and_count(monkeypatch):
    from router.routing.ring import WorkerRing
    rng = random.Random(3)
    for size in (1, 2, 3, 7, 40):
        ring = WorkerRing([f"w{i}" for i in range(size)], vnodes=rng.choice([1, 4, 160]))
        keys = [rng.getrandbits(64) for _ in range(300)] + [0, 2 ** 64 - 1, -1, -(2 ** 70), 2 ** 80 + 5, True]
        keys += ring._points[:5] if ring._points else [p for p in ring._points]
        ring.successors(0, 1)  # built
        keys += ring._points[:20] + [p - 1 for p in ring._points[:20]]
        for key in keys:
            for count in (0, 1, 3, size, size + 2):
                monkeypatch.setattr(hotloop, "hot", C_LOOPS)
                compiled = ring.successors(key, count)
                monkeypatch.setattr(hotloop, "hot", None)
                assert compiled == ring.successors(key, count), (size, key, count)
    assert C_LOOPS.ring_successors(b"", [], 5, 3) is NotImplemented
    assert C_LOOPS.ring_successors(b"\0" * 8, ["a"], "key", 3) is NotImplemented


@needs_c
def test_least_loaded_pops_and_pushes_as_heapq_does(monkeypatch):
    """Same answer and the very same heap afterwards, stale entries dropped alike."""
    rng = random.Random(11)
    for trial in range(40):
        boards = []
        for hot in (C_LOOPS, None):
            monkeypatch.setattr(hotloop, "hot", hot)
            board = LoadBoard(SpeedProfile(max_num_seqs=2))
            r = random.Random(trial)
            ids = [f"w{i}" for i in range(r.randint(1, 30))]
            for w in ids:
                board.add_worker(w)
            answers = []
            for step in range(200):
                w = r.choice(ids)
                roll = r.random()
                if roll < 0.4:
                    board.dispatch(w, r.randint(1, 5000), step * 0.01)
                elif roll < 0.5:
                    board.set_routable(w, r.random() < 0.7)
                elif roll < 0.55:
                    board.remove_worker(w)
                    board.add_worker(w)
                skip = frozenset(r.sample(ids, r.randint(0, min(3, len(ids)))))
                answers.append(board.least_loaded(r.choice([0, 1, 2, 5]), step * 0.01, skip))
            boards.append((answers, list(board._heap)))
        assert boards[0] == boards[1]
    assert C_LOOPS.least_loaded((), {}, 2, frozenset()) is NotImplemented
    assert C_LOOPS.least_loaded([], {}, 2, ["not", "a set"]) is NotImplemented


@needs_c
def test_choose_keeps_the_candidates_alive_while_a_worker_id_runs_python_code():
    """A worker id's ``__lt__`` (the near-tie break) that empties the candidates list must not free
    the candidate the C loop is about to return (it scores a copy of the list)."""
    import gc

    class Id:
        def __eq__(self, other):
            return False

        def __lt__(self, other):
            candidates.clear()
            gc.collect()
            reuse.extend(Candidate(worker_id="x" * i, tokens_per_s=float(i), service_s=1.0) for i in range(50))
            return True

        __hash__ = object.__hash__

    reuse: list = []
    candidates = [Candidate(worker_id=Id(), tokens_per_s=1000.0, service_s=1.0) for _ in range(3)]

    chosen = C_LOOPS.choose(candidates, 0, 100, 0, 1.0, 1.0, 1000.0, 0.001, 0.05)[0]

    assert type(chosen) is Candidate and type(chosen.worker_id) is Id and chosen.tokens_per_s == 1000.0


# -- Python code called from inside the loops (a worker id's __eq__, a lookup's get) ---------------
# The router passes internal lists of str, so none of this is reachable from a request; these pin
# that the module stays memory-safe for whoever calls it with anything (each crashed or read freed
# memory before the C loops held what they borrow).

@needs_c
def test_candidates_hold_the_record_and_their_lists_while_python_code_runs():
    """The depth lookup's ``get`` drops the worker's record and empties the caller's lists; a
    successor's ``__eq__`` does it again: the record built is the record as it was read."""
    import copy
    import gc

    board = LoadBoard(SpeedProfile())
    board.add_worker("w0", block_size=16)
    record = copy.copy(board.loads()["w0"])
    expected = (record.rate_now, record.in_system, record.over_limit_now, record.service_s)

    class Worker:
        __hash__ = object.__hash__

    class Lookup(dict):
        def get(self, key, default=None):
            havoc()
            return 2

    class Successor:
        def __eq__(self, other):
            havoc()
            return False

        __hash__ = object.__hash__

    junk: list = []

    def havoc():
        loads.clear()
        ids.clear()
        successors.clear()
        gc.collect()
        for i in range(200):  # reuse what was freed
            twin = copy.copy(board.loads()["w0"])
            twin.rate_now, twin.service_s = float(i) + 0.5, 9.0
            junk.append(twin)

    wid = Worker()
    loads = {wid: record}
    del record
    ids = [wid]
    successors = [Successor(), Successor(), wid]

    built = C_LOOPS.candidates(ids, successors, Lookup(), True, {}, loads, 128.0, 10**6, 0.0)

    (c,) = built
    assert c.worker_id is wid and c.matched_chunks == 2 and c.ring_rank == 2
    assert (c.tokens_per_s, c.in_system, c.over_limit, c.service_s) == expected


@needs_c
def test_a_ring_whose_owners_change_during_the_walk_stops_with_an_error():
    import gc

    class Owner:
        def __eq__(self, other):
            owners.clear()
            gc.collect()
            return False

        __hash__ = object.__hash__

    owners = ["a", Owner(), "b", Owner(), "c"]
    points = b"".join(i.to_bytes(8, "little" if __import__("sys").byteorder == "little" else "big")
                      for i in range(10, 60, 10))
    with pytest.raises(RuntimeError):
        C_LOOPS.ring_successors(points, owners, 0, 5)
    assert C_LOOPS.ring_successors(points, ["a", "b"] * 2 + ["c"], 0, 1.0) is NotImplemented  # Python's count


@needs_c
def test_bind_takes_only_its_own_types_slots_and_binds_once():
    import dataclasses

    from router.routing.load import WorkerLoad
    from router.routing.policy import NOT_ON_RING

    borrowed = type("Borrowed", (), {name: Candidate.__dict__[name] for name in Candidate.__slots__})
    with pytest.raises(TypeError, match="of its own"):
        C_LOOPS.bind(borrowed, WorkerLoad, NOT_ON_RING)
    assert C_LOOPS.bind(Candidate, WorkerLoad, NOT_ON_RING) is None  # the same types again: fine
    twin = dataclasses.make_dataclass("Twin", [(f.name, f.type, f) for f in dataclasses.fields(Candidate)],
                                      slots=True)
    with pytest.raises(RuntimeError, match="already bound"):
        C_LOOPS.bind(twin, WorkerLoad, NOT_ON_RING)
    with pytest.raises(RuntimeError, match="already bound"):
        C_LOOPS.bind(Candidate, WorkerLoad, NOT_ON_RING + 1)


@needs_c
def test_a_module_reloaded_with_new_record_types_falls_back_to_the_python_loops(monkeypatch):
    import dataclasses

    twin = dataclasses.make_dataclass("Twin", [(f.name, f.type, f) for f in dataclasses.fields(Candidate)],
                                      slots=True)
    monkeypatch.setattr(hotloop, "Candidate", twin)  # what importlib.reload(policy) would leave
    with pytest.warns(RuntimeWarning, match="Python loops"):
        assert hotloop.load() is None


@needs_c
def test_least_loaded_reads_odd_inputs_as_python_does():
    heap = [(0.0, 0, "gone")]
    assert C_LOOPS.least_loaded(heap, {"gone": None}, 1, frozenset()) == [] and heap == []  # None: stale

    class Everything(frozenset):
        def __contains__(self, item):
            return True

    assert C_LOOPS.least_loaded([(0.0, 0, "w")], {}, 1, Everything()) is NotImplemented
    assert C_LOOPS.least_loaded([(0.0, 0, "w")], {}, 1.0, frozenset()) is NotImplemented


@needs_c
def test_least_loaded_puts_each_entry_back_once_when_a_comparison_fails():
    """An entry's ``__lt__`` raises at the n-th comparison, for every n: whatever the phase, no entry
    is on the heap twice and at most the one being popped is lost (as with heapq)."""
    board = LoadBoard(SpeedProfile(max_num_seqs=64))
    for i in range(12):
        board.add_worker(f"w{i}")
        board.dispatch(f"w{i}", 100 * ((i * 7) % 12) + 1, 0.0)
    calls = [0, 0]  # comparisons so far, the one that raises

    class Key:
        def __init__(self, value):
            self.value = value

        def __eq__(self, other):
            return self.value == other.value

        def __lt__(self, other):
            calls[0] += 1
            if calls[0] == calls[1]:
                raise ValueError("comparison failed")
            return self.value < other.value

        __hash__ = None

    original = [(Key(busy), version, wid) for busy, version, wid in board._heap]
    workers = dict(board.loads())
    live = {id(entry) for entry in original if workers[entry[2]].heap_version == entry[1]}
    assert len(live) == 12 < len(original)
    calls[:] = [0, -1]
    C_LOOPS.least_loaded(list(original), workers, len(original), frozenset())
    total = calls[0]
    assert total > 20
    failures = 0
    for n in range(1, total + 1):
        heap = list(original)
        calls[:] = [0, n]
        try:
            C_LOOPS.least_loaded(heap, workers, len(original), frozenset())
        except ValueError:
            failures += 1
        kept = [id(entry) for entry in heap]
        assert len(kept) == len(set(kept)), n
        assert set(kept) <= {id(entry) for entry in original}, n
        assert len(live - set(kept)) <= 1, n  # stale entries may go for good, as in Python's loop
    assert failures == total


@needs_c
def test_a_workers_cached_figures_are_refreshed_to_the_same_floats_in_c_and_python():
    """LoadBoard's refresh (rate_now, slot_wait_s, over_limit_now) on random workers, both ways, to the bit."""
    from router.routing.load import WorkerLoad

    assert board_module._refresh is C_LOOPS.refresh  # what the board calls once the C module is bound
    rng = random.Random(11)
    for _ in range(20_000):
        fields = dict(worker_id="w", prefill_tokens_per_s=rng.choice([rng.uniform(100, 50_000), 4000, 1e-300]),
                      decode_step_s=rng.uniform(1e-3, 0.1), max_num_batched_tokens=rng.choice([0, 1, 512, 8192]),
                      max_num_seqs=rng.choice([1, 64, 256]), block_size=16, max_inflight=rng.choice([2, 128, 512]),
                      service_s=rng.uniform(0.01, 5.0))
        a, b = WorkerLoad(**fields), WorkerLoad(**fields)
        state = dict(in_system=rng.choice([0, 1, rng.randint(0, 600)]),
                     reported_running=rng.choice([0, rng.randint(0, 300)]),
                     reported_running_tokens=rng.choice([0, rng.randint(1, 2_000_000)]),
                     capacity_tokens=rng.choice([0, rng.randint(1, 3_000_000)]), cap=rng.choice([0, 0, 1, 3]))
        tickets = rng.randint(0, 4)
        for w in (a, b):
            for name, value in state.items():
                setattr(w, name, value)
            w.tickets = set(range(tickets))
        C_LOOPS.refresh(a)
        board_module.refresh_python(b)
        assert (a.rate_now.hex(), a.slot_wait_s.hex(), a.over_limit_now) == \
               (b.rate_now.hex(), b.slot_wait_s.hex(), b.over_limit_now), fields
    # a value it was not written for goes to Python: the same answer, or the same error
    odd = WorkerLoad("w", 0.0, 0.02, 512, 64, 16, 128, 1.0)
    with pytest.raises(ZeroDivisionError):
        C_LOOPS.refresh(odd)
    big = WorkerLoad("w", 5000.0, 0.02, 512, 64, 16, 128, 1.0)
    big.reported_running, big.reported_running_tokens, big.capacity_tokens = 3, 7, 2**62
    twin = WorkerLoad("w", 5000.0, 0.02, 512, 64, 16, 128, 1.0)
    twin.reported_running, twin.reported_running_tokens, twin.capacity_tokens = 3, 7, 2**62
    C_LOOPS.refresh(big)
    board_module.refresh_python(twin)
    assert (big.rate_now, big.slot_wait_s, big.over_limit_now) == (twin.rate_now, twin.slot_wait_s, twin.over_limit_now)


@needs_c
def test_a_chain_hash_that_is_not_an_int_leaves_the_depth_to_the_lookups_get():
    """Its __eq__ (run by the index's dict lookup) drops the worker's holder; the C loop must not
    read the holder it borrowed, and answers as ``get`` (depth_of) does: 0."""
    out = run_isolated("""
        import gc
        from router.routing import hotloop
        from router.routing.balancer import _DepthLookup
        from router.routing.index import PrefixIndex
        from router.routing.load import LoadBoard
        index = PrefixIndex()
        index.insert([1, 2, 3], "a", 0.0, True)
        class Hash(int):
            __hash__ = int.__hash__
            def __eq__(self, other):
                holder = index._live.pop("a")
                for entry in index._map.values():
                    entry.pop(holder, None)
                del holder
                gc.collect()
                return int(self) == int(other)
        board = LoadBoard()
        board.add_worker("a")
        lookup = _DepthLookup({}, index, [Hash(1), 2, 3], 100.0)
        built = hotloop.hot.candidates(["a"], ["a"], lookup, True, {}, board.loads(), 10.0, 100, 100.0)
        print([c.matched_chunks for c in built])
    """)
    assert out == "[0]\n"


@needs_c
def test_a_depth_lookup_that_cannot_be_read_directly_holds_nothing_and_raises_only_as_python_would():
    """Its ``_now`` raises: the C loop takes nothing it keeps (no reference leaked per call), and
    raises only where Python's loop calls ``get`` (a worker that is not among the longest matches)."""
    from router.routing.balancer import _DepthLookup
    from router.routing.index import PrefixIndex
    import sys

    class Lookup(_DepthLookup):
        @property
        def _now(self):
            raise RuntimeError("boom")

        @_now.setter
        def _now(self, value):
            pass

    index = PrefixIndex()
    index.insert([1, 2], "a", 0.0, True)
    board = LoadBoard()
    board.add_worker("a")
    loads = board.loads()
    hashes = [1, 2]
    before = sys.getrefcount(hashes), sys.getrefcount(index._map), sys.getrefcount(index._live)

    for _ in range(100):
        with pytest.raises(RuntimeError, match="boom"):
            C_LOOPS.candidates(["a"], ["a"], Lookup({}, index, hashes, 100.0), True, {}, loads, 10.0, 100, 100.0)
    (c,) = C_LOOPS.candidates(["a"], ["a"], Lookup({"a": 2}, index, hashes, 100.0), True, {}, loads, 10.0, 100, 100.0)

    assert c.matched_chunks == 2
    assert (sys.getrefcount(hashes), sys.getrefcount(index._map), sys.getrefcount(index._live)) == before


@needs_c
@pytest.mark.parametrize("in_system", [0, 2])
def test_a_worker_with_no_sequence_slots_is_refreshed_as_python_does(in_system):
    """max_num_seqs 0: Python divides by the slots (ZeroDivisionError once a request waits)."""
    from router.routing.load import WorkerLoad

    outcomes = []
    for refresh in (C_LOOPS.refresh, board_module.refresh_python):
        w = WorkerLoad("w", 1000.0, 0.01, 512, 4, 16, 64, 1.0)
        w.max_num_seqs, w.in_system = 0, in_system
        try:
            refresh(w)
            outcomes.append((w.rate_now, w.slot_wait_s, w.over_limit_now))
        except ZeroDivisionError as exc:
            outcomes.append((w.rate_now, str(exc)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == "float division by zero"  # a request ahead (the new one): Python divides




def _random_index(rng: random.Random):
    """A PrefixIndex in a random state: chains of shared prefixes held by many workers, holes (removed,
    evicted or expired hashes in the middle), cleared and forgotten workers; and prompts to match."""
    from router.routing.index import PrefixIndex

    index = PrefixIndex(max_entries=rng.choice([40, 200, 10_000]), optimistic_ttl_s=rng.choice([1.0, 30.0]),
                        confirmed_ttl_s=rng.choice([5.0, 3600.0]))
    workers = [f"w{i}" for i in range(rng.randint(2, 30))]
    chains = [[rng.getrandbits(62) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 4))]
    now = 0.0
    for _ in range(rng.randint(1, 80)):
        now += rng.choice([0.0, 0.1, 2.0])
        chain = rng.choice(chains)
        worker = rng.choice(workers)
        roll = rng.random()
        if roll < 0.7:
            index.insert(chain[:rng.randint(1, len(chain))], worker, now, confirmed=rng.random() < 0.5)
        elif roll < 0.8:
            index.remove(rng.sample(chain, rng.randint(1, min(3, len(chain)))), worker)
        elif roll < 0.85:
            index.clear_worker(worker)
        elif roll < 0.88:
            index.forget_worker(worker)
        elif roll < 0.95:
            index.demote(chain[:rng.randint(1, len(chain))], worker, now)
        else:
            index.sweep(now, budget=rng.randint(1, 50))
    prompts = [chain[:rng.randint(1, len(chain))] + [rng.getrandbits(62) for _ in range(rng.randint(0, 2))]
               for chain in chains]
    return index, prompts, now


@needs_c
@pytest.mark.parametrize("seed", range(200))
def test_the_index_matches_many_holders_as_python_does(seed):
    """PrefixIndex._match_many (more holders of the first chunk than the limit): the same matches and
    the same most-recently-used order of the index as its Python method, on a random index."""
    import copy

    from router.routing.index import _Holder

    rng = random.Random(seed)
    index, prompts, now = _random_index(rng)
    other = copy.deepcopy(index)
    for _ in range(6):
        hashes = rng.choice(prompts)
        if rng.random() < 0.5:
            hashes = tuple(hashes)
        at = now + rng.choice([0.0, 0.5, 1.5, 4.0, 40.0])
        limit = rng.choice([0, 1, 2, 3, 8])
        compiled = C_LOOPS.match_many(index._map, index._live, hashes, at, limit, _Holder)
        assert compiled is not NotImplemented  # plain values: the C answers (no Python fallback compared)
        python = other._match_many_python(hashes, at, limit)
        assert compiled == python
        assert list(index._map) == list(other._map)  # the same hashes made most recently used
        assert [(h, dict((k.worker_id, v) for k, v in e.items())) for h, e in index._map.items()] == \
               [(h, dict((k.worker_id, v) for k, v in e.items())) for h, e in other._map.items()]


@needs_c
def test_the_index_match_declines_what_it_was_not_written_for():
    """An int ``now`` or expiry, a hash that is not an int: NotImplemented, and the Python method's
    answer (it starts again: the most-recently-used moves made before declining are made again in
    the same order, so the index ends as Python alone leaves it)."""
    from router.routing.index import PrefixIndex, _Holder

    def build():
        index = PrefixIndex()
        for w in ("a", "b", "c"):
            index.insert([1, 2, 3, 4], w, 0.0, confirmed=True)
        index.insert([9], "a", 0.0, confirmed=True)
        return index

    index = build()
    assert C_LOOPS.match_many(index._map, index._live, [1, 2, 3], 1, 2, _Holder) is NotImplemented  # int now
    assert C_LOOPS.match_many(index._map, index._live, [1, "2", 3], 1.0, 2, _Holder) is NotImplemented
    assert C_LOOPS.match_many(index._map, index._live, [1, 2, 3], 1.0, 2, object) is NotImplemented
    # an int expiry of the last holder of hash 3, met only when the matches are collected (after
    # the walk made hashes 1..3 most recently used; the walk stops at each entry's first live holder)
    index._map[3][index._live["c"]] = 3600
    python = build()
    python._map[3][python._live["c"]] = 3600
    assert C_LOOPS.match_many(index._map, index._live, [1, 2, 3], 1.0, 3, _Holder) is NotImplemented
    assert list(index._map) == [4, 9, 1, 2, 3]
    assert index._match_many([1, 2, 3], 1.0, 3) == python._match_many_python([1, 2, 3], 1.0, 3) \
        == ({"a": 3, "b": 3, "c": 3}, False)
    assert list(index._map) == list(python._map) == [4, 9, 1, 2, 3]


@needs_c
def test_the_index_match_holds_what_it_reads_and_leaks_nothing():
    """A map key whose __eq__ drops the index's entries mid-walk (its hash equals a prompt hash):
    no crash under the debug allocators, Python's answer, and no references kept."""
    out = run_isolated("""
        import sys
        from router.routing import hotloop
        from router.routing.index import PrefixIndex, _Holder

        class Evil:
            def __init__(self, index):
                self.index = index
            def __hash__(self):
                return 2
            def __eq__(self, other):
                self.index._map.clear()
                self.index._live.clear()
                return False

        answers = set()
        for _ in range(50):
            for run in ("c", "python"):
                index = PrefixIndex()
                for w in ("a", "b", "c"):
                    index.insert([1, 2, 3], w, 0.0, confirmed=True)
                index._map[Evil(index)] = {}
                if run == "c":
                    answers.add(repr(hotloop.hot.match_many(index._map, index._live, [1, 2, 3], 1.0, 2, _Holder)))
                else:
                    answers.add(repr(index._match_many_python([1, 2, 3], 1.0, 2)))
        print(answers)
        index = PrefixIndex()
        for w in ("a", "b", "c"):
            index.insert([1, 2, 3], w, 0.0, confirmed=True)
        hashes = [1, 2, 3]
        before = sys.getrefcount(hashes), sys.getrefcount(index._map), sys.getrefcount(index._live)
        for _ in range(1000):
            found = hotloop.hot.match_many(index._map, index._live, hashes, 1.0, 2, _Holder)
        del found
        print((sys.getrefcount(hashes), sys.getrefcount(index._map), sys.getrefcount(index._live)) == before)
    """)
    assert out.split() == ["{'({},", "True)'}", "True"]
