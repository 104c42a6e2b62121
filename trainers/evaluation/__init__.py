"""Evaluation of a causal LM on verifiable prompts and held-out preference pairs."""
