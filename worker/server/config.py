"""ServerConfig: every setting of ``prefixlb worker`` (the server, and the engine it builds), one schema for flags, env and YAML.

Flags are the field names with dashes (``--kv-blocks``), environment variables
``PREFIXLB_WORKER_<FIELD>`` (``PREFIXLB_WORKER_KV_BLOCKS``), YAML keys the field names
(``--config FILE``); precedence defaults < YAML < env < flags (protocol/settings.py).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from protocol.hashing import DEFAULT_CHUNK_SIZE
from protocol.keys import DEFAULT_PREFIX
from protocol.settings import SettingsError, load_settings, parse_size, setting
from worker.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from worker.simulator.profiles import SIM_MAX_NUM_BATCHED_TOKENS, SIM_MAX_NUM_SEQS

ENV_PREFIX = "PREFIXLB_WORKER_"
PRESETS = ("tiny", "small")


@dataclass(slots=True)
class ServerConfig:
    """Settings of one worker process (real engine or ``--simulate``)."""

    model: str = setting("tiny", "model: a preset (tiny, small) or a Hugging Face checkpoint directory")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8001, "port to listen on", minimum=0, maximum=65535)
    tokenizer: str | None = setting(None, "directory with the tokenizer.json (and tokenizer_config.json) to use "
                                    "(default: the checkpoint's; a checkpoint without one is refused)")
    chat_template: str | None = setting(None, "Jinja chat template FILE replacing the checkpoint's (a checkpoint "
                                        "without one serves completions only)")
    tool_call_parser: str | None = setting(
        None, "turn the model's tool calls into tool_calls (vLLM's parser names): hermes (<tool_call> JSON; "
        "Hermes, Qwen 2.5) or llama3_json (Llama 3.x); without it, requests with tools the model may call are a "
        "400", choices=("hermes", "llama3_json"))
    served_model_name: str | None = setting(None, "model name clients use (default: the preset or directory name)")
    kv_blocks: int | None = setting(None, "number of KV-cache blocks (wins over --kv-memory)", minimum=1)
    kv_memory: str | None = setting(None, "KV-cache size, e.g. 512MiB (simulated: per GPU)")
    block_size: int = setting(16, "tokens per KV block", minimum=1, maximum=1024)
    # The CPU KV tier: docs/kv-tier.md
    cpu_kv_blocks: int | None = setting(None, "blocks of the CPU KV tier under the GPU prefix cache "
                                        "(wins over --cpu-kv-memory)", minimum=0)
    cpu_kv_memory: str | None = setting(None, "CPU KV tier size in host memory, e.g. 64GiB (default: no tier; "
                                        "simulated: per GPU)")
    cpu_kv_store_policy: str = setting("write_back", "when blocks go down to the CPU tier: on GPU eviction "
                                       "(write_back), when cached (write_through), or on eviction if reused "
                                       "--cpu-kv-min-hits times (selective)",
                                       choices=("write_back", "write_through", "selective"))
    cpu_kv_min_hits: int = setting(2, "reuses a block needs before selective stores it", minimum=1)
    cpu_kv_load_bandwidth: float | None = setting(None, "host->device GB/s the tier assumes until it has measured "
                                                  "its copies (default: 25 on CUDA, 10 on CPU; simulated: the "
                                                  "GPU profile's)", minimum=1e-9)
    max_num_seqs: int | None = setting(
        None, f"most sequences in one batch (default {DEFAULT_MAX_NUM_SEQS}; simulated {SIM_MAX_NUM_SEQS})",
        minimum=1)
    max_num_batched_tokens: int | None = setting(
        None, f"token budget of one engine step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; simulated "
        f"{SIM_MAX_NUM_BATCHED_TOKENS})", minimum=1)
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's)", minimum=1)
    attention_backend: str = setting("auto", "attention implementation", choices=("auto", "triton", "torch"))
    device: str = setting("cpu", "torch device of the real engine (cpu, cuda)")
    dtype: str = setting("auto", "dtype of the weights and the KV cache (auto: the checkpoint's torch_dtype, "
                         "float32 on a CPU)", choices=("auto", "bfloat16", "float16", "float32"))
    gpu_memory_utilization: float = setting(
        0.9, "on CUDA without --kv-blocks/--kv-memory: the share of the GPU's total memory this worker uses; "
        "the KV cache gets what the weights and one step's activations leave", minimum=0.01, maximum=1.0)
    threads: int | None = setting(None, "torch CPU threads (default: torch's choice)", minimum=1)
    seed: int = setting(0, "engine seed (sampling without a per-request seed)")
    worker_id: str | None = setting(None, "this worker's id (default: <host>-<port>)")
    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, "router chunk size in bytes, for KV events", minimum=1)
    redis: str | None = setting(None, "Redis URL (redis://, rediss://, unix:// or "
                                "redis+sentinel://H:P[,H:P...]/SERVICE): register, heartbeat load, publish KV events")
    redis_prefix: str = setting(DEFAULT_PREFIX, "prefix of every Redis key")
    redis_signing_key: str | None = setting(None, "this worker's key for signing what it writes into Redis "
                                            "(`prefixlb signing-key --worker-id ID` prints it from the fleet "
                                            "secret routers take as --redis-signing-secret)", secret=True)
    redis_signing_key_file: str | None = setting(None, "file holding --redis-signing-key (what the Helm chart's "
                                                 "and compose's key derivation writes: the worker holds only "
                                                 "its own key, never the fleet secret)")
    advertise: str | None = setting(None, "URL routers use to reach this worker (default: http://host:port)")
    heartbeat_interval: float = setting(0.5, "seconds between load reports", minimum=0.05, maximum=60)
    registry_ttl: float = setting(5.0, "seconds a registration lives without a heartbeat", minimum=1)
    kv_stream_maxlen: int = setting(100_000, "approximate bound of the Redis KV-event stream", minimum=100)
    publish_queue: int = setting(10_000, "events buffered while Redis is slow or down (oldest dropped)", minimum=1)
    kv_event_table: int | None = setting(None, "block->chunk mapping entries kept (default: 4 x KV blocks)", minimum=1)
    max_body_bytes: int = setting(16 * 1024 * 1024, "largest request body accepted (413 above), bytes or e.g. 16MiB",
                                  minimum=1024, size=True)
    body_timeout: float = setting(30.0, "seconds a client may take to send its body (408 after)", minimum=0.1)
    drain_timeout: float = setting(30.0, "seconds SIGTERM waits for in-flight requests", minimum=0)
    api_keys: list[str] = setting(list, "API key required as 'Authorization: Bearer <key>' on every "
                                  "endpoint but /health, /load and /metrics (repeatable; none: open)",
                                  flag="--api-key", secret=True)
    simulate: bool = setting(False, "serve a simulated GPU: latency model instead of a model")
    gpu: str = setting("H100-80G", "simulated GPU profile (A100-80G, H100-80G, H200)")
    sim_model: str = setting("llama-3-8b", "simulated model profile (llama-3-8b, llama-3-70b)")
    sim_tp: int | None = setting(None, "simulated tensor-parallel degree (default: smallest that fits)", minimum=1)
    time_scale: float = setting(1.0, "simulated worker runs this many times faster than real time", minimum=1e-3)
    sim_output_len: int = setting(256, "simulated tokens before EOS (unless ignore_eos / max_tokens)", minimum=1)
    sim_answers: str | None = setting(None, "simulated: answer each prompt with its recorded answer from this CSV "
                                      "(columns prompt, <model>_response)")
    sim_answers_model: str | None = setting(None, "simulated: the model whose recorded answers to replay "
                                            "(its <model>_response column; default served name)")
    enable_lora: bool = setting(False, "serve LoRA adapters (implied by --lora); load more at run time "
                                "with POST /v1/load_lora_adapter")
    lora_modules: list[str] = setting(list, "LoRA adapter NAME=DIR in PEFT format, loaded at start; "
                                      "requests select it with \"model\": NAME (repeatable)", flag="--lora")
    max_loras: int = setting(4, "GPU slots: most distinct LoRA adapters in one batch", minimum=1, maximum=1024)
    max_cpu_loras: int | None = setting(None, "LoRA adapters kept in host memory (default 4 x --max-loras)",
                                        minimum=1)
    max_lora_rank: int = setting(16, "largest LoRA rank accepted (sizes the GPU slots)", minimum=1, maximum=1024)
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "log lines as text (key=value) or json (one object per line, each key a "
                              "field)", choices=("text", "json"))

    @property
    def model_name(self) -> str:
        """The name clients send as ``model``."""
        if self.served_model_name:
            return self.served_model_name
        if self.simulate:
            return self.sim_answers_model or self.sim_model
        if self.model in PRESETS:
            return self.model
        return Path(self.model).resolve().name or self.model

    @property
    def resolved_worker_id(self) -> str:
        """The worker id: ``--worker-id`` or ``<hostname>-<port>``."""
        return self.worker_id or f"{socket.gethostname()}-{self.port}"

    @property
    def advertise_url(self) -> str:
        """The URL other processes reach this worker at."""
        if self.advertise:
            return self.advertise.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves adapters (``--enable-lora`` or any ``--lora``)."""
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_specs(self) -> list[tuple[str, str]]:
        """``--lora NAME=DIR`` as ``(name, dir)`` pairs; SettingsError if malformed or repeated."""
        out: list[tuple[str, str]] = []
        for spec in self.lora_modules:
            name, sep, path = spec.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise SettingsError(f"--lora {spec!r}: expected NAME=DIR")
            if any(name == seen for seen, _ in out):
                raise SettingsError(f"--lora: adapter name {name!r} given twice")
            if name == self.model_name:
                raise SettingsError(f"--lora: adapter name {name!r} is the served model's name")
            out.append((name, path))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise SettingsError("--max-cpu-loras must be >= --max-loras")
        return out

    @property
    def kv_memory_bytes(self) -> int | None:
        """``--kv-memory`` in bytes."""
        return parse_size(self.kv_memory) if self.kv_memory else None

    @property
    def cpu_kv_memory_bytes(self) -> int | None:
        """``--cpu-kv-memory`` in bytes."""
        return parse_size(self.cpu_kv_memory) if self.cpu_kv_memory else None

    def cpu_kv_settings(self) -> dict:
        """The EngineConfig fields of the CPU KV tier."""
        bandwidth = self.cpu_kv_load_bandwidth
        return dict(cpu_kv_blocks=self.cpu_kv_blocks, cpu_kv_memory_bytes=self.cpu_kv_memory_bytes,
                    cpu_kv_store_policy=self.cpu_kv_store_policy, cpu_kv_min_hits=self.cpu_kv_min_hits,
                    cpu_kv_load_bytes_per_s=bandwidth * 1e9 if bandwidth is not None else None)


# `prefixlb worker --help`, by topic (a setting in no group is listed under "other options").
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "served_model_name", "tokenizer", "chat_template", "tool_call_parser", "dtype", "device",
              "attention_backend", "threads", "seed"),
    "KV cache and batching": ("kv_blocks", "kv_memory", "gpu_memory_utilization", "block_size", "max_num_seqs",
                              "max_num_batched_tokens", "max_model_len"),
    "CPU KV tier": ("cpu_kv_blocks", "cpu_kv_memory", "cpu_kv_store_policy", "cpu_kv_min_hits",
                    "cpu_kv_load_bandwidth"),
    "server": ("host", "port", "worker_id", "advertise", "api_keys", "max_body_bytes", "body_timeout",
               "drain_timeout", "log_level", "log_format"),
    "Redis and KV events": ("redis", "redis_prefix", "redis_signing_key", "redis_signing_key_file",
                            "heartbeat_interval", "registry_ttl",
                            "kv_stream_maxlen", "publish_queue", "kv_event_table", "chunk_size"),
    "LoRA adapters": ("enable_lora", "lora_modules", "max_loras", "max_cpu_loras", "max_lora_rank"),
    "simulated GPU (--simulate)": ("simulate", "gpu", "sim_model", "sim_tp", "time_scale", "sim_output_len",
                                   "sim_answers", "sim_answers_model"),
}


def load_server_config(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    """Read a ServerConfig from ``argv`` (``prefixlb worker`` flags), env and ``--config``."""
    cfg = load_settings(ServerConfig, argv, env_prefix=ENV_PREFIX, environ=environ)
    check_server_config(cfg)
    return cfg


def check_server_config(cfg: ServerConfig) -> None:
    """Refuse what the engine would refuse later, now (SettingsError): sizes, the Redis URL,
    recorded answers, ``--lora`` specs."""
    if cfg.kv_memory:
        parse_size(cfg.kv_memory)  # refuse a bad size now, not when the engine starts
    if cfg.cpu_kv_memory:
        parse_size(cfg.cpu_kv_memory)
    if cfg.redis:
        from protocol.redis_url import RedisURLError, check_redis_url

        try:
            check_redis_url(cfg.redis)
        except RedisURLError as exc:
            raise SettingsError(f"--redis: {exc}") from None
    if cfg.sim_answers is not None and (not cfg.simulate or not cfg.sim_answers_model):
        raise SettingsError("--sim-answers replays recorded answers on a simulated worker: it needs --simulate "
                            "and --sim-answers-model")
    if cfg.sim_answers_model is not None and cfg.sim_answers is None:
        raise SettingsError("--sim-answers-model needs --sim-answers FILE")
    _ = cfg.lora_specs  # raises SettingsError on a malformed --lora
    if cfg.redis_signing_key_file is not None and cfg.redis_signing_key is not None:
        raise SettingsError("give --redis-signing-key or --redis-signing-key-file, not both")
    if cfg.redis_signing_key is not None and not _is_signing_key(cfg.redis_signing_key):
        raise SettingsError("--redis-signing-key: expected the 64 hex digits `prefixlb signing-key` prints")


def _is_signing_key(key: str) -> bool:
    return len(key) == 64 and all(c in "0123456789abcdefABCDEF" for c in key)


def signing_key(cfg: ServerConfig) -> str | None:
    """The worker's Redis signing key: ``--redis-signing-key``, or read from
    ``--redis-signing-key-file`` when the worker starts (the file is written just before, by the
    chart's init container or compose's ``signing-keys``); SettingsError if unreadable or malformed."""
    if cfg.redis_signing_key_file is None:
        return cfg.redis_signing_key
    try:
        with open(cfg.redis_signing_key_file, encoding="ascii") as fh:
            key = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"--redis-signing-key-file: cannot read it: {exc}") from None
    if not _is_signing_key(key):
        raise SettingsError(f"--redis-signing-key-file {cfg.redis_signing_key_file}: expected the 64 hex digits "
                            "`prefixlb signing-key` writes")
    return key
