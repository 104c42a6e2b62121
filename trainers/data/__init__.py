"""Data: reading, normalizing, validating and tokenizing rows (:mod:`.rows`), clipping long
texts, token lengths from the data, collators, and the built-in addition task."""
