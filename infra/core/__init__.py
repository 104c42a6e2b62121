"""The lower half of ``infra``: settings, the config package, compute, launching, processes, locks,
fingerprints and the cache stores. It imports only ``trainers`` (and libraries), never ``tasks``,
``flows`` or ``infra.ops``, so every layer may build on it."""
