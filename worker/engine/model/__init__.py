"""The Llama-family model (Llama, Qwen2, Mistral), its presets, loading and saving."""
