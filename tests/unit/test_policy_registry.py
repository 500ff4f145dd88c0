"""The policy registry: one module per policy, and everything that names policies reads it.

The toy policy below is defined and registered here, in the test, and nowhere else: routing
with it through the Balancer, and having the router's and the simulator's ``--policy``, the
admin API and the routing report accept it, proves that adding a policy touches one file.
"""
from __future__ import annotations

from typing import AbstractSet, Iterator, Mapping, Sequence

import pytest

from bench.routing_report import prefixlb_rows
from bench.sim.config import ENV_PREFIX as SIM_ENV_PREFIX
from bench.sim.config import SimSettings
from protocol.settings import SettingsError, load_settings
from router.config import load_router_config
from router.context import ConfigError, build_context
from router.routing.balancer import Balancer
from router.routing.load import LoadBoard, SpeedProfile
from router.routing.policies import (Policy, choose, decision_for, get_policy, policy_names, register,
                                     under_limit, unregister)
from router.routing.policy import DEFAULT_POLICY, Candidate, Decision, NoCapacity, PolicyConfig, RouteRequest
from router.routing.prompt import PromptKey, prompt_key

WORKERS = ["w1", "w2", "w3", "w4"]


class LastById(Policy):
    """A toy: every routable worker is a candidate, and the greatest id under its limit wins."""

    name = "last_by_id"

    def candidates(self, view: Balancer, request: RouteRequest, prompt: PromptKey, matches: Mapping[str, int],
                   now: float, exclude: AbstractSet[str], config: PolicyConfig) -> list[Candidate]:
        return [view.candidate(w, matches.get(w, 0), prompt, request.prompt_tokens, now)
                for w in view.rotation_order if w not in exclude]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], config: PolicyConfig) -> Decision:
        chosen = max(under_limit(candidates), key=lambda c: c.worker_id)
        return decision_for(request, chosen, "toy", chosen.pending_s)


@pytest.fixture
def toy() -> Iterator[str]:
    register(LastById)
    yield LastById.name
    unregister(LastById.name)


def key(text: str) -> PromptKey:
    return prompt_key({"model": "tiny", "prompt": text}, chat=False, chunk_size=128, ring_key_chunks=8)


def test_the_built_in_policies_are_registered_in_listing_order_the_default_first():
    assert policy_names() == ("cache_aware", "least_load", "consistent_hash", "round_robin")
    assert DEFAULT_POLICY == policy_names()[0]
    assert [get_policy(n).uses_affinity for n in policy_names()] == [True, False, False, False]


def test_a_policy_registered_from_one_file_routes_through_the_balancer(toy):
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0), max_inflight=1)
    b = Balancer(PolicyConfig(policy=toy), chunk_size=128, board=board, tokens_per_byte=1.0)
    for w in WORKERS:
        b.add_worker(w, block_size=16)
    p = key("x" * 600)
    d = b.decide(p, now=0.0)
    assert (d.worker_id, d.reason, d.prompt_tokens) == ("w4", "toy", 600)
    b.dispatch(d, p, now=0.0)  # w4 is now at its limit of 1
    assert b.decide(p, now=0.0).worker_id == "w3"
    assert b.decide(p, now=0.0, exclude={"w3"}).worker_id == "w2"
    assert choose(RouteRequest(prompt_tokens=10), [Candidate(worker_id="a", tokens_per_s=1.0),
                                                   Candidate(worker_id="b", tokens_per_s=1.0)],
                  PolicyConfig(policy=toy)).worker_id == "b"
    with pytest.raises(NoCapacity):
        b.decide(p, now=0.0, exclude={"w1", "w2", "w3"})


def test_a_registered_policy_is_accepted_wherever_policy_names_are_checked(toy):
    assert policy_names()[-1] == toy
    assert load_router_config(["--policy", toy], environ={}).policy == toy
    assert load_settings(SimSettings, ["--policy", toy], env_prefix=SIM_ENV_PREFIX, environ={}).policy == toy
    ctx = build_context(load_router_config([], environ={}))
    assert ctx.apply_runtime({"policy": toy})["policy"] == toy
    assert ctx.balancer.config.policy == toy
    assert prefixlb_rows((0.5,))[-1] == (f"prefixlb {toy}", toy, None)


def test_an_unregistered_policy_is_refused_everywhere():
    assert "last_by_id" not in policy_names()
    with pytest.raises(SystemExit):  # argparse's "invalid choice"
        load_router_config(["--policy", "last_by_id"], environ={})
    with pytest.raises(SettingsError, match="is not one of cache_aware, least_load, consistent_hash, round_robin"):
        load_router_config([], environ={"PREFIXLB_ROUTER_POLICY": "last_by_id"})
    with pytest.raises(ConfigError, match="policy: 'last_by_id' is not one of"):
        build_context(load_router_config([], environ={})).apply_runtime({"policy": "last_by_id"})
    b = Balancer(PolicyConfig(policy="last_by_id"))
    b.add_worker("w1")
    with pytest.raises(ValueError, match="unknown policy 'last_by_id'"):
        b.decide(key("hello"), now=0.0)


def test_a_name_is_registered_once():
    class Impostor(LastById):
        name = "cache_aware"

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)
    assert type(get_policy("cache_aware")).__name__ == "CacheAware"


def test_the_report_runs_a_policy_that_reads_affinity_at_each_affinity_and_the_others_once():
    assert prefixlb_rows((0.5, 0.8, 1.0)) == [
        ("prefixlb cache_aware a=0.5", "cache_aware", 0.5), ("prefixlb cache_aware a=0.8", "cache_aware", 0.8),
        ("prefixlb cache_aware a=1", "cache_aware", 1.0), ("prefixlb least_load", "least_load", None),
        ("prefixlb consistent_hash", "consistent_hash", None), ("prefixlb round_robin", "round_robin", None)]
