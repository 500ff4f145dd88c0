"""Run-time config changes (``PUT /admin/config``, the config shared through Redis) are checked by
the one settings schema, and the router's defaults are those of the pure parts it wires."""
from __future__ import annotations

import math

import pytest

from protocol.settings import SettingsError, parse_setting
from router.config import RouterConfig, load_router_config
from router.context import ConfigError, build_context
from router.routing.balancer import Balancer
from router.routing.index import PrefixIndex
from router.routing.load import SpeedProfile
from router.routing.policy import DEFAULT_AFFINITY, PolicyConfig


@pytest.fixture
def ctx():
    return build_context(load_router_config([], environ={}))


@pytest.mark.parametrize("values, message", [
    ({"affinity": 3}, "affinity: 3.0 is above the maximum 1.0"),
    ({"affinity": -0.1}, "affinity: -0.1 is below the minimum 0.0"),
    ({"affinity": math.nan}, "affinity: NaN is not a number in range"),
    ({"affinity": True}, "affinity: invalid value True"),
    ({"affinity": "high"}, "affinity: invalid value 'high'"),
    ({"policy": "random"}, "policy: 'random' is not one of cache_aware, least_load, consistent_hash, round_robin"),
    ({"policy": ["cache_aware"]}, "policy: invalid value ['cache_aware']"),
    ({"prewarm_top": 1025}, "prewarm_top: 1025 is above the maximum 1024"),
    ({"prewarm_top": 2.5}, "prewarm_top: invalid value 2.5"),
    ({"prewarm_top": None}, "prewarm_top: a value is required"),
    ({"chunk_size": 64}, "not changeable at run time: chunk_size"),
])
def test_a_runtime_change_outside_the_schema_is_refused_with_the_schemas_reason(ctx, values, message):
    with pytest.raises(ConfigError) as exc:
        ctx.apply_runtime(values)
    assert str(exc.value) == message
    assert ctx.runtime_config() == {"affinity": DEFAULT_AFFINITY, "policy": "cache_aware", "prewarm_top": 0}


def test_one_refused_value_applies_none_of_the_others(ctx):
    with pytest.raises(ConfigError):
        ctx.apply_runtime({"affinity": 0.3, "prewarm_top": 4, "policy": "random"})
    assert ctx.runtime_config() == {"affinity": DEFAULT_AFFINITY, "policy": "cache_aware", "prewarm_top": 0}
    assert ctx.balancer.config.affinity == DEFAULT_AFFINITY


def test_the_config_shared_through_redis_arrives_as_text_and_is_converted(ctx):
    ctx._shared_config({"affinity": "0.35", "policy": "least_load", "prewarm_top": "4", "version": "12.5"})
    assert ctx.runtime_config() == {"affinity": 0.35, "policy": "least_load", "prewarm_top": 4}
    assert (ctx.balancer.config.affinity, ctx.balancer.config.policy) == (0.35, "least_load")
    assert ctx.prewarmer.top == 4
    ctx._shared_config({"affinity": "nan"})  # refused (and logged), nothing changes
    assert ctx.runtime_config()["affinity"] == 0.35


def test_the_flags_refuse_nan_for_a_bounded_number():
    with pytest.raises(SettingsError, match="NaN is not a number in range"):
        load_router_config(["--affinity", "nan"], environ={})
    assert parse_setting(RouterConfig, "affinity", "0.25") == 0.25
    with pytest.raises(SettingsError, match="unknown setting 'affinty'"):
        parse_setting(RouterConfig, "affinty", 0.5)


def test_the_routers_defaults_are_the_defaults_of_the_parts_it_wires():
    cfg = load_router_config([], environ={})
    assert cfg.policy_config() == PolicyConfig()
    assert cfg.speed_profile() == SpeedProfile()
    ctx = build_context(cfg)
    index = PrefixIndex()
    assert (ctx.balancer.index.max_entries, ctx.balancer.index.optimistic_ttl_s, ctx.balancer.index.confirmed_ttl_s) \
        == (index.max_entries, index.optimistic_ttl_s, index.confirmed_ttl_s)
    plain = Balancer()
    fields = ("chunk_size", "default_tokens_per_byte", "feedback_clear_after")
    assert [getattr(ctx.balancer, f) for f in fields] == [getattr(plain, f) for f in fields]
    assert ctx.balancer.ring.vnodes == plain.ring.vnodes
