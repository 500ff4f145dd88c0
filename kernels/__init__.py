"""Attention over the paged KV cache: torch references (`attention_ref`), Triton kernels
(`triton_kv_write`, `triton_decode`, `triton_extend`); multi-LoRA deltas (`lora_ref`,
`triton_lora`); and the selector of both (`backend`).

Importing this package imports neither triton nor any kernel: see `kernels/backend.py`.
"""
