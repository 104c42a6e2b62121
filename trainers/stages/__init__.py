"""The stage spec (:mod:`.spec`): what an algorithm registers. The registry with every stage in it
is :mod:`trainers.catalog`."""
