"""Scoring sequences: log-probs, reference passes and their views, evaluation statistics, and
reward models as scorers."""
