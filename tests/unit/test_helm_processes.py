"""Helm ``router.processes``: ``--processes`` on the router only when above 1, refused without Redis."""
from __future__ import annotations

import helm_python as helm
import pytest

from router.config import check_router_config
from tests.deploy_support import container, find, load_router_config, render_chart


def router_args(values: dict) -> list[str]:
    return container(find(render_chart(values), "Deployment", "-router"), "router")["args"]


def test_one_process_by_default_and_no_flag_for_it():
    args = router_args({})
    assert not any(a.startswith("--processes") for a in args)
    assert load_router_config(args).processes == 1


def test_processes_become_the_routers_flag_with_the_bundled_or_an_external_redis():
    assert "--processes=4" in router_args({"router": {"processes": 4}})
    external = {"redis": {"enabled": False, "url": "redis://cache:6379/0"}, "router": {"processes": 3}}
    cfg = load_router_config(router_args(external))
    assert cfg.processes == 3


def test_processes_without_redis_are_refused_at_render_time():
    with pytest.raises(helm.HelmError) as exc:
        render_chart({"redis": {"enabled": False}, "discovery": {"mode": "static"},
                      "router": {"processes": 2}})
    assert "router.processes > 1 needs Redis" in str(exc.value)


@pytest.mark.parametrize("bad", [0, 257, "2"])
def test_the_schema_bounds_processes(bad):
    with pytest.raises(helm.HelmError):
        render_chart({"router": {"processes": bad}})


def test_a_rendered_router_with_processes_passes_the_routers_own_checks():
    cfg = load_router_config(router_args({"router": {"processes": 2}}),
                             environ={"PREFIXLB_ROUTER_REDIS": "redis://r:6379/0"})
    check_router_config(cfg)
