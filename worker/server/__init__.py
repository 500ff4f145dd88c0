"""The worker's HTTP server over the engine: OpenAI API and probes (``api/``), metrics, KV events and the Redis publisher."""
