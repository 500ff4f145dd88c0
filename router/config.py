"""RouterConfig: every router setting, read from flags, ``PREFIXLB_ROUTER_*`` env and YAML.

``prefixlb router --help`` lists them all; ``GET /admin/config`` shows them (secrets masked).
``affinity`` and ``policy`` can also be changed at run time through the admin API, and are then
shared by all routers through Redis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from protocol import DEFAULT_CHUNK_SIZE, DEFAULT_PREFIX
from protocol.settings import SettingsError, load_settings, setting
from router.routing.balancer import DEFAULT_FEEDBACK_CLEAR_AFTER, DEFAULT_TOKENS_PER_BYTE
from router.routing.index import DEFAULT_CONFIRMED_TTL_S, DEFAULT_MAX_ENTRIES, DEFAULT_OPTIMISTIC_TTL_S
from router.routing.load import SpeedProfile
from router.routing.policies import policy_names
from router.routing.policy import DEFAULT_AFFINITY, DEFAULT_POLICY, PolicyConfig
from router.routing.prompt import DEFAULT_RING_KEY_CHUNKS
from router.routing.ring import DEFAULT_VNODES

ENV_PREFIX = "PREFIXLB_ROUTER_"
# Admin tokens this project has shipped in examples: anyone who read them knows them.
PLACEHOLDER_ADMIN_TOKENS = ("change-me",)
# The pure parts' own defaults are the flags' defaults: one source for each.
_POLICY = PolicyConfig()
_SPEED = SpeedProfile()


@dataclass(slots=True)
class RouterConfig:
    """The router's settings (flags / env / YAML, one schema)."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on", minimum=0, maximum=65535)
    workers: list[str] = setting(list, "worker: [KIND=]URL[,kv-events=tcp://H:P][,kv-replay=tcp://H:P], KIND one of "
                                 "prefixlb, vllm, sglang, openai (default: detected), e.g. vllm=http://127.0.0.1:8001 "
                                 "(repeatable)",
                                 flag="--worker")
    tokenizers: list[str] = setting(list, "MODEL=DIR: the tokenizer.json and tokenizer_config.json of a model served "
                                    "by vLLM workers with kv-events, for exact cached-token routing (repeatable; "
                                    "needs the engines extra)", flag="--tokenizer")
    policy: str = setting(DEFAULT_POLICY, "routing policy", choices=policy_names)
    affinity: float = setting(DEFAULT_AFFINITY, "affinity strength a in [0, 1] (0: least pending work, 1: follow "
                              'the cache); see docs/routing.md, "Affinity strength"', minimum=0.0, maximum=1.0)
    redis: str | None = setting(None, "Redis URL for shared state: redis://, rediss://, unix:// or "
                                "redis+sentinel://H:P[,H:P...]/SERVICE (none: everything in memory)")
    redis_prefix: str = setting(DEFAULT_PREFIX, "prefix of every Redis key")
    redis_signing_secret: str | None = setting(None, "fleet secret: accept from Redis only registrations, load "
                                               "reports and KV events signed with their worker's key "
                                               "(protocol/signing.py; workers: --redis-signing-key)", secret=True)
    admin_token: str | None = setting(None, "bearer token of the /admin/ API (unset: admin API refused; the "
                                      "placeholder 'change-me' older examples shipped is refused at start)",
                                      secret=True)
    admin_port: int | None = setting(None, "serve the /admin/ API on this port (same --host) instead of --port",
                                     minimum=1, maximum=65535)
    k8s_selector: str | None = setting(None, "discover workers as Kubernetes pods with this label selector")
    k8s_namespace: str = setting("default", "namespace of the worker pods (with --k8s-selector)")
    k8s_port: int = setting(8000, "port of the worker pods (with --k8s-selector)", minimum=1, maximum=65535)
    session_headers: list[str] = setting(("x-session-id", "x-user-id"),
                                         "header carrying a session key (repeatable)", flag="--session-header")
    session_fields: list[str] = setting(("user", "session_id"),
                                        "body field carrying a session key (repeatable)", flag="--session-field")
    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, "bytes per prefix chunk (must match the workers')",
                              minimum=16, maximum=65536)
    ring_key_chunks: int = setting(DEFAULT_RING_KEY_CHUNKS, "leading chunks that place a new prefix on the ring", minimum=1)
    index_max_entries: int = setting(DEFAULT_MAX_ENTRIES, "prefix-index capacity in chunk hashes (LRU beyond)",
                                     minimum=1)
    index_optimistic_ttl: float = setting(DEFAULT_OPTIMISTIC_TTL_S, "seconds an unconfirmed (optimistic) index entry lives",
                                          minimum=0.1)
    index_confirmed_ttl: float = setting(DEFAULT_CONFIRMED_TTL_S, "seconds a KV-event-confirmed index entry lives unused",
                                         minimum=1.0)
    max_inflight_per_worker: int = setting(0, "hard per-worker in-flight limit (0: twice the worker's "
                                           "max_num_seqs)", minimum=0)
    tie_tolerance: float = setting(_POLICY.tie_tolerance, "relative cost difference treated as a tie (then the ring "
                                   "decides)", minimum=0.0, maximum=1.0)
    attention_knee_tokens: float = setting(_POLICY.attention_knee_tokens, "context length at which attention costs as much "
                                           "as the linear prefill work", minimum=1.0)
    hash_load_factor: float = setting(_POLICY.hash_load_factor, "consistent_hash: max load as a multiple of the mean",
                                      minimum=1.0)
    ring_candidates: int = setting(_POLICY.ring_candidates, "ring successors of the key a decision considers", minimum=1)
    load_candidates: int = setting(_POLICY.load_candidates, "least-loaded workers a decision considers", minimum=0)
    match_candidates: int = setting(_POLICY.match_candidates, "most prefix holders a decision considers (the longest matches)",
                                    minimum=1)
    adapter_routing: bool = setting(_POLICY.adapter_routing, "LoRA requests: add the adapter's load and slot wait "
                                    "to the predicted TTFT and keep each adapter on the workers its traffic needs "
                                    "(docs/lora.md, \"Routing by adapter\"); off: by prefix only")
    adapter_spare: int = setting(_POLICY.adapter_spare, "workers an adapter may run on beyond what its traffic "
                                 "needs (a busy home's spill)", minimum=0, maximum=1024)
    vnodes: int = setting(DEFAULT_VNODES, "virtual nodes per worker on the ring", minimum=1)
    tokens_per_byte: float = setting(DEFAULT_TOKENS_PER_BYTE, "tokens per rendered byte until learned from the workers",
                                     minimum=0.001, maximum=4.0)
    prefill_tokens_per_s: float = setting(_SPEED.prefill_tokens_per_s, "worker prefill speed until it reports a measured one",
                                          minimum=1.0)
    decode_step_s: float = setting(_SPEED.decode_step_s, "worker decode step time until it reports a measured one",
                                   minimum=0.0)
    max_num_seqs: int = setting(_SPEED.max_num_seqs, "worker batch size until it reports its own", minimum=1)
    feedback_clear_after: int = setting(DEFAULT_FEEDBACK_CLEAR_AFTER, "consecutive cached-token overpredictions that clear a "
                                        "worker's index entries", minimum=1)
    health_interval: float = setting(2.0, "seconds between active health checks of a worker", minimum=0.05)
    health_jitter: float = setting(0.2, "random +- fraction of the health interval", minimum=0.0,
                                   maximum=0.9)
    health_timeout: float = setting(2.0, "seconds a health check may take", minimum=0.05)
    unhealthy_after: int = setting(2, "consecutive failed requests or checks that open a worker's "
                                 "breaker (take it out of rotation)", minimum=1)
    registry_interval: float = setting(1.0, "seconds between reads of the Redis registry, loads and "
                                       "config", minimum=0.05)
    snapshot_interval: float = setting(30.0, "seconds between index snapshots written to Redis",
                                       minimum=0.5)
    startup_sync_timeout: float = setting(10.0, "seconds to wait for Redis state before serving anyway",
                                          minimum=0.0)
    max_body_bytes: int = setting(16 * 1024 * 1024, "largest request body accepted (413 beyond), bytes or "
                                  "e.g. 16MiB", minimum=1024, size=True)
    connect_timeout: float = setting(5.0, "seconds to connect to a worker", minimum=0.05)
    read_timeout: float = setting(600.0, "seconds a worker may stay silent mid-response", minimum=0.1)
    max_attempts: int = setting(3, "workers tried before the first byte, on connection errors, timeouts "
                                "and 5xx", minimum=1, maximum=10)
    retry_deadline: float = setting(30.0, "seconds after its arrival a request may still be retried on "
                                    "another worker", minimum=0.0)
    body_timeout: float = setting(30.0, "seconds a client may take to send its request body (408 after)",
                                  minimum=0.1)
    max_inflight: int = setting(4096, "requests the router serves at once (0: no global limit); beyond, "
                                "they queue", minimum=0)
    max_queue: int = setting(256, "requests that may wait for capacity (global or per-worker limit); "
                             "beyond, 429 (bytes or e.g. 64MiB)", minimum=0, size=True)
    max_queue_bytes: int = setting(64 * 1024 * 1024, "request-body bytes that may wait in the queue; "
                                   "beyond, 429 (bytes or e.g. 64MiB)", minimum=0, size=True)
    queue_timeout: float = setting(5.0, "seconds a request may wait in the queue before a 429", minimum=0.0)
    breaker_cool_down: float = setting(1.0, "seconds a worker's open breaker waits before a good probe may "
                                       "half-open it (doubles on each failed trial)", minimum=0.0)
    breaker_max_cool_down: float = setting(30.0, "longest breaker cool-down", minimum=0.0)
    half_open_successes: int = setting(3, "successful requests or probes that close a half-open breaker",
                                       minimum=1)
    half_open_max_inflight: int = setting(2, "requests of this router a half-open (recovering) worker takes "
                                          "at once", minimum=1)
    registry_grace: float = setting(15.0, "seconds a healthy worker stays after its Redis registration "
                                    "vanished (e.g. Redis restarted empty)", minimum=0.0)
    processes: int = setting(1, "router processes sharing --port (SO_REUSEPORT) and state through --redis, one "
                             "/metrics view and one admin API; >1 needs --redis and a fixed --port "
                             '(docs/operations.md, "Several processes per router")', minimum=1, maximum=256)
    fast_front: bool = setting(True, "serve plain POST /v1/completions and /v1/chat/completions with the router's "
                               "lean HTTP/1.1 front (everything else, and --no-fast-front: aiohttp) "
                               '(docs/operations.md, "The fast front")')
    shutdown_grace: float = setting(25.0, "seconds requests in flight may finish after SIGTERM; then open streams "
                                    "end with an SSE error event (shutting_down)", minimum=0.0)
    api_keys: list[str] = setting(list, "API key clients must send as 'Authorization: Bearer <key>' on "
                                  "/v1/* (repeatable; none: open)", flag="--api-key", secret=True)
    worker_api_key: str | None = setting(None, "API key the router sends to workers (their --api-key)",
                                         secret=True)
    worker_allow: list[str] = setting(list, "allowed worker hosts: CIDR, IP, or host-name wildcard ('*' "
                                      "within one DNS label), with optional :port (repeatable; none: any "
                                      "http(s) host but link-local and cloud-metadata ones, which must be "
                                      "listed)")
    prewarm_top: int = setting(0, "send a joining worker the K hottest prefixes (max_tokens=1) before it "
                               "takes traffic (0: off)", minimum=0, maximum=1024)
    prewarm_max_bytes: int = setting(1024 * 1024, "largest request body kept as a pre-warm sample "
                                     "(bytes or e.g. 1MiB)", minimum=0, size=True)
    prewarm_timeout: float = setting(30.0, "seconds pre-warming a worker may take before it gets "
                                     "traffic anyway", minimum=0.1)
    virtual_models: str | None = setting(None, "YAML file of virtual models (route, cascade) the router serves "
                                         'beside the workers\' models; see docs/cost-and-cascades.md, "Virtual models"')
    price_book: str | None = setting(None, "YAML price book: every answer is priced (cost headers, /admin/usage, "
                                     "prefixlb_router_cost_usd_total); none: tokens are counted, not priced")
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "log lines as text (key=value) or json (one object per line, each key a "
                              "field)", choices=("text", "json"))

    def policy_config(self) -> PolicyConfig:
        """The policy knobs as the pure policy sees them."""
        return PolicyConfig(policy=self.policy, affinity=self.affinity, tie_tolerance=self.tie_tolerance,
                            attention_knee_tokens=self.attention_knee_tokens,
                            hash_load_factor=self.hash_load_factor, ring_candidates=self.ring_candidates,
                            load_candidates=self.load_candidates, match_candidates=self.match_candidates,
                            adapter_routing=self.adapter_routing, adapter_spare=self.adapter_spare)

    def speed_profile(self) -> SpeedProfile:
        """The speed assumed for a worker until its reports say otherwise."""
        return SpeedProfile(prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=self.decode_step_s,
                            max_num_seqs=self.max_num_seqs)


def check_router_config(cfg: RouterConfig) -> None:
    """What the schema cannot check: worker specs, ``--tokenizer`` entries, a placeholder admin
    token, an admin port that is the API's (SettingsError)."""
    from router.fleet.backends import InvalidWorkerSpec, parse_worker_spec

    if cfg.admin_token is not None and cfg.admin_token.strip().lower() in PLACEHOLDER_ADMIN_TOKENS:
        raise SettingsError(f"--admin-token: {cfg.admin_token.strip()!r} is a placeholder from the examples; "
                            "set a token of your own (or none: the admin API is then refused)")
    if cfg.processes > 1 and not cfg.redis:
        raise SettingsError(f"--processes {cfg.processes} needs --redis: the processes share the prefix index, "
                            "loads and decisions through it, as several routers do")
    if cfg.processes > 1 and (cfg.port == 0 or cfg.admin_port == 0):
        raise SettingsError(f"--processes {cfg.processes} needs a fixed --port (0 would give each process a port "
                            "of its own)")
    if cfg.admin_port is not None and cfg.admin_port == cfg.port:
        raise SettingsError(f"--admin-port {cfg.admin_port} is --port; give the admin API a port of its own")
    for spec in cfg.workers:
        try:
            parse_worker_spec(spec)
        except InvalidWorkerSpec as exc:
            raise SettingsError(f"--worker {spec!r}: {exc}") from None
    if cfg.redis:
        from protocol.redis_url import RedisURLError, check_redis_url

        try:
            check_redis_url(cfg.redis)
        except RedisURLError as exc:
            raise SettingsError(f"--redis: {exc}") from None
    for entry in cfg.tokenizers:
        model, sep, directory = entry.partition("=")
        if not sep or not model or not directory:
            raise SettingsError(f"--tokenizer {entry!r}: expected MODEL=DIR")
    load_virtual_model_files(cfg)


def load_virtual_model_files(cfg: RouterConfig) -> tuple[dict, "PriceBook | None"]:
    """The virtual models and the price book ``cfg`` names, validated (SettingsError naming the
    file and the bad key)."""
    from router.cost.price_book import PriceBook, PriceBookError, load_price_book
    from router.virtual_models.config import VirtualModelError, load_virtual_models

    book: PriceBook | None = None
    virtual: dict = {}
    try:
        if cfg.price_book:
            book = load_price_book(cfg.price_book)
    except PriceBookError as exc:
        raise SettingsError(f"--price-book {cfg.price_book}: {exc}") from None
    try:
        if cfg.virtual_models:
            virtual = load_virtual_models(cfg.virtual_models)
    except VirtualModelError as exc:
        raise SettingsError(f"--virtual-models {cfg.virtual_models}: {exc}") from None
    return virtual, book


# `prefixlb router --help`, by topic (a setting in no group is listed under "other options").
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "listening, access and logs": ("host", "port", "processes", "fast_front", "admin_token", "admin_port", "api_keys",
                                   "shutdown_grace", "log_level", "log_format"),
    "workers and discovery": ("workers", "worker_allow", "worker_api_key", "k8s_selector", "k8s_namespace",
                              "k8s_port", "tokenizers", "registry_interval", "registry_grace"),
    "Redis": ("redis", "redis_prefix", "redis_signing_secret", "snapshot_interval", "startup_sync_timeout"),
    "routing policy": ("policy", "affinity", "session_headers", "session_fields", "chunk_size", "ring_key_chunks",
                       "tie_tolerance", "attention_knee_tokens", "hash_load_factor", "ring_candidates",
                       "load_candidates", "match_candidates", "vnodes", "tokens_per_byte", "prefill_tokens_per_s",
                       "decode_step_s", "max_num_seqs", "feedback_clear_after", "adapter_routing", "adapter_spare"),
    "virtual models and cost": ("virtual_models", "price_book"),
    "prefix index": ("index_max_entries", "index_optimistic_ttl", "index_confirmed_ttl"),
    "limits and admission": ("max_body_bytes", "body_timeout", "max_inflight", "max_inflight_per_worker",
                             "max_queue", "max_queue_bytes", "queue_timeout"),
    "proxy, retries and health checks": ("connect_timeout", "read_timeout", "max_attempts", "retry_deadline",
                                         "health_interval", "health_jitter", "health_timeout", "unhealthy_after",
                                         "breaker_cool_down", "breaker_max_cool_down", "half_open_successes",
                                         "half_open_max_inflight"),
    "pre-warming": ("prewarm_top", "prewarm_max_bytes", "prewarm_timeout"),
}


def load_router_config(argv: Sequence[str] | None = None,
                       environ: Mapping[str, str] | None = None) -> RouterConfig:
    """RouterConfig from defaults < YAML (``--config``) < ``PREFIXLB_ROUTER_*`` env < flags."""
    return load_settings(RouterConfig, argv, env_prefix=ENV_PREFIX, environ=environ)
