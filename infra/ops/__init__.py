"""The top half of ``infra``: the command line, servers, workers and deployments. It builds on the
bottom half (``infra.config``, ``infra.settings``), which never imports from here."""
