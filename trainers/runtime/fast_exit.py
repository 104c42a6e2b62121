"""End a process without the interpreter's teardown, once its exit hooks have run.

Used by launched ranks (:func:`trainers.runtime.launched_process.run_as_launched_process`), whose teardown after a
finished job now and then aborted in torch's C++ state (SIGABRT, "terminate called without an
active exception": 1 run in about 12 of the FSDP test), and by the ``alignflow`` flow commands
(``infra.ops.cli``) and the test session (``tests/conftest.py``), where tearing down an interpreter
that imported torch, transformers, Prefect and MLflow only frees memory and took 4-7 s on a 2-core machine.

``atexit`` runs its hooks last-registered first: the hooks registered *after*
:func:`end_at_exit_without_teardown` (Prefect's, MLflow's, torch's, those of what the job imports) run
before it; those registered *before* it never run. Call it early, and only where none of those
earlier hooks is needed.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Callable


def end_at_exit_without_teardown(exit_code: Callable[[], int | None]) -> None:
    """At exit: flush logging and the standard streams, then end with ``exit_code()`` (None: exit
    as usual, with the teardown)."""

    def end() -> None:
        code = exit_code()
        if code is None:
            return
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(end)
