"""One replica: the paged-KV prefix-caching engine (``engine/``: scheduler, KV cache, model,
sampler), its HTTP server (``server/``: OpenAI API, probes, metrics, the Redis publisher of load
reports and KV events) and the simulated engine (``simulator/``: the same engine with a latency
model in place of the model)."""
