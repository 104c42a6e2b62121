"""Infrastructure. Bottom half: ``config`` (the experiment schema) and ``settings`` (where state
lives); light to import, used by every layer. Top half, ``infra.ops``: the command line, servers,
workers and deployments."""
