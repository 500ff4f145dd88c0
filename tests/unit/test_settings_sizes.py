"""Sizes are accepted as ``16MiB`` wherever a size is asked for: flags, environment, YAML and the
admin API's run-time settings, for the router and the worker alike."""
from __future__ import annotations

import pytest

from protocol.settings import SettingsError, parse_setting
from router.config import RouterConfig, load_router_config
from worker.server.config import load_server_config


def test_router_sizes_take_units_from_flags_env_and_yaml(tmp_path):
    yaml = tmp_path / "router.yaml"
    yaml.write_text("prewarm-max-bytes: 512KiB\n")
    cfg = load_router_config(["--max-body-bytes", "16MiB", "--config", str(yaml)],
                             environ={"PREFIXLB_ROUTER_MAX_QUEUE_BYTES": "1GB"})
    assert (cfg.max_body_bytes, cfg.max_queue_bytes, cfg.prewarm_max_bytes) == (16 * 2**20, 10**9, 512 * 1024)
    assert load_router_config(["--max-body-bytes", "2097152"], environ={}).max_body_bytes == 2 * 2**20


def test_a_run_time_size_setting_takes_units_too():
    assert parse_setting(RouterConfig, "max_queue_bytes", "64MiB") == 64 * 2**20


def test_worker_sizes_take_units():
    cfg = load_server_config(["--max-body-bytes", "1.5MiB", "--kv-memory", "512MiB"], environ={})
    assert (cfg.max_body_bytes, cfg.kv_memory_bytes) == (int(1.5 * 2**20), 512 * 2**20)


@pytest.mark.parametrize("value, message", [("16 parsecs", "invalid size '16 parsecs'"),
                                            ("1kB", "below the minimum 1024")])
def test_a_bad_size_or_one_out_of_range_is_refused_naming_the_setting(value, message):
    with pytest.raises(SettingsError, match=message):
        load_server_config(["--max-body-bytes", value], environ={})
    with pytest.raises(SettingsError, match="max_body_bytes"):
        load_server_config(["--max-body-bytes", value], environ={})
