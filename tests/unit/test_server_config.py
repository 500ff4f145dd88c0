"""ServerConfig: one schema read from flags, PREFIXLB_WORKER_* environment variables and YAML."""
from __future__ import annotations

import pytest

from protocol.settings import SettingsError, describe, redact_url
from worker.server.config import load_server_config, parse_size


def test_defaults_run_the_tiny_model_on_localhost():
    cfg = load_server_config([], environ={})
    assert (cfg.model, cfg.host, cfg.port, cfg.block_size, cfg.chunk_size) == ("tiny", "127.0.0.1", 8001, 16, 128)
    assert (cfg.model_name, cfg.advertise_url, cfg.redis, cfg.simulate) == ("tiny", "http://127.0.0.1:8001", None, False)


def test_flags_beat_env_beat_yaml(tmp_path):
    yaml_file = tmp_path / "w.yaml"
    yaml_file.write_text("port: 9001\nblock-size: 32\nkv_blocks: 100\n")
    env = {"PREFIXLB_WORKER_PORT": "9002", "PREFIXLB_WORKER_CONFIG": str(yaml_file)}
    cfg = load_server_config(["--port", "9003"], environ=env)
    assert (cfg.port, cfg.block_size, cfg.kv_blocks) == (9003, 32, 100)
    assert load_server_config([], environ=env).port == 9002


def test_served_model_name_defaults_to_the_profile_or_directory(tmp_path):
    assert load_server_config(["--simulate"], environ={}).model_name == "llama-3-8b"
    ckpt = tmp_path / "my-llama"
    ckpt.mkdir()
    assert load_server_config(["--model", str(ckpt)], environ={}).model_name == "my-llama"
    assert load_server_config(["--served-model-name", "x", "--simulate"], environ={}).model_name == "x"


def test_advertise_and_worker_id():
    cfg = load_server_config(["--host", "0.0.0.0", "--port", "8123", "--worker-id", "w9"], environ={})
    assert (cfg.advertise_url, cfg.resolved_worker_id) == ("http://127.0.0.1:8123", "w9")
    cfg = load_server_config(["--advertise", "http://10.0.0.5:8001/"], environ={})
    assert cfg.advertise_url == "http://10.0.0.5:8001"


@pytest.mark.parametrize("text, size", [("1048576", 1048576), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9),
                                        ("1.5GiB", int(1.5 * 2**30)), ("64 kb", 64_000)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_bad_values_are_refused_with_the_setting_named():
    with pytest.raises(SettingsError, match="kv_memory|invalid size"):
        load_server_config(["--kv-memory", "lots"], environ={})
    with pytest.raises(SettingsError, match="block_size"):
        load_server_config(["--block-size", "0"], environ={})
    with pytest.raises(SettingsError, match="port"):
        load_server_config([], environ={"PREFIXLB_WORKER_PORT": "eighty"})


def test_lora_flags_from_the_command_line_env_and_yaml(tmp_path):
    cfg = load_server_config(["--lora", "sql=/a/sql", "--lora", " chat = /a/chat ", "--max-loras", "2"], environ={})
    assert (cfg.lora_specs, cfg.lora_enabled, cfg.max_loras, cfg.max_cpu_loras) == (
        [("sql", "/a/sql"), ("chat", "/a/chat")], True, 2, None)
    assert load_server_config([], environ={"PREFIXLB_WORKER_LORA_MODULES": "a=/x,b=/y"}).lora_specs == [
        ("a", "/x"), ("b", "/y")]
    assert not load_server_config([], environ={}).lora_enabled
    assert load_server_config(["--enable-lora"], environ={}).lora_enabled


@pytest.mark.parametrize("argv,match", [
    (["--lora", "sql"], "expected NAME=DIR"),
    (["--lora", "=/a"], "expected NAME=DIR"),
    (["--lora", "a=/x", "--lora", "a=/y"], "given twice"),
    (["--lora", "tiny=/x"], "the served model's name"),
    (["--max-loras", "8", "--max-cpu-loras", "4"], "--max-cpu-loras must be >= --max-loras"),
])
def test_bad_lora_flags_are_refused_when_the_config_is_read(argv, match):
    with pytest.raises(SettingsError, match=match):
        load_server_config(argv, environ={})


def test_describe_masks_secret_settings_and_the_password_of_a_url_setting():
    cfg = load_server_config(["--redis", "redis://default:pw-42@redis:6379/0", "--api-key", "k1"], environ={})
    shown = describe(cfg)
    assert (shown["redis"], shown["api_keys"]) == ("redis://default:***@redis:6379/0", "***")
    assert "pw-42" not in repr(shown)


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
    ("rediss://user:p%40ss@h:6380/2", "rediss://user:***@h:6380/2"),
    ("redis://u:p@w@h:1", "redis://u:***@h:1"),  # an unescaped "@" in the password
    ("redis+sentinel://:pw@s1:26379,s2:26379/mymaster?sentinel_password=spw&db=1",
     "redis+sentinel://:***@s1:26379,s2:26379/mymaster?sentinel_password=***&db=1"),
    ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock?password=***"),
    ("redis://user@redis:6379/0", "redis://user@redis:6379/0"),  # no password, nothing to hide
    ("http://127.0.0.1:8001", "http://127.0.0.1:8001"),
    ("worker-*:8000", "worker-*:8000"),
])
def test_redact_url_masks_only_the_password(url, shown):
    assert redact_url(url) == shown
