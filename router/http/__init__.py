"""The HTTP edge: OpenAI routes, the admin API, the proxy, SSE handling and admission control."""
