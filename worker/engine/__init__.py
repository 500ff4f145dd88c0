"""The engine: requests in, tokens out, no I/O -- scheduler, paged KV cache with prefix caching, model, sampler."""
