"""Infrastructure in two layers. ``infra.core``, below ``tasks``: settings, config, compute,
launching, processes, locks, fingerprints and cache stores (imports only ``trainers``).
``infra.ops``, the shell on top: the command line, servers, workers and deployments (may import
anything)."""
