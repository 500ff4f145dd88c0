"""One replica: the paged-KV prefix-caching engine (``engine.py``, ``scheduler.py``,
``kv_cache/``, ``model/``), its HTTP server (``server.py``, ``api/``), the simulated worker
(``simulator/``) and the KV-event publisher."""
