"""Models: loading checkpoints and tokenizers, the built-in model, dtypes and devices, LoRA
adapters, a tokenizer's identity, and where a model's completions end (stop tokens)."""
