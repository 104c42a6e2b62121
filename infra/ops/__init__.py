"""The shell of ``infra``: the command line, servers, workers and deployments. It may import every
layer; ``infra.core`` never imports from here."""
