"""Model definitions (Llama family) and checkpoint loaders (GGUF, safetensors)."""
