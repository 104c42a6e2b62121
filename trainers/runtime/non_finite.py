"""The error of a stage that diverged, apart from the guard that raises it
(:class:`trainers.runtime.callbacks.FiniteGuard`), so callers tell it apart without importing torch."""


class NonFiniteTraining(RuntimeError):
    """A stage diverged: a loss it logged, or its weights, are no longer finite numbers."""
