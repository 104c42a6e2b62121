"""Every use of a Prefect internal (outside its documented API) in alignflow, in one place.

Supported: Prefect :data:`SUPPORTED` (pyproject.toml's range); ``tests/test_compat.py`` checks that
each internal below still exists and behaves as this module assumes. When Prefect moves one, this
module and that test are what change.

- The temporary API server: the command and the private environment variables that Prefect's own
  ``SubprocessASGIServer`` runs it with (``infra.ops.prefect_api`` starts it before Prefect is
  imported; ``infra.ops.runs`` finds those of killed runs by them).
- The layout of a result record file and of an object in Prefect's JSON serializer
  (``tasks.results`` reads cached results as plain data, never through Prefect's decoder).
- The build steps of a ``prefect.yaml`` deployment, run as ``prefect deploy`` runs them
  (``alignflow serve``: Prefect has no public API that serves a deployments file).

Prefect is imported on use only: importing this module is cheap and leaves Prefect unimported.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, NamedTuple

SUPPORTED = ("3.9.1", "4")  # >= the first, < the second: pyproject.toml's "prefect>=3.9.1,<4"

# The temporary server: the API app factory and the variables ``SubprocessASGIServer`` sets (no UI;
# ``create_app`` reads PREFECT__SERVER_EPHEMERAL: no services, PREFECT__SERVER_FINAL: last app of its process).
TEMPORARY_SERVER_APP = "prefect.server.api.server:create_app"
TEMPORARY_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
EPHEMERAL_MARK = b"PREFECT__SERVER_EPHEMERAL=1"  # in the environment of a temporary server


def temporary_server_command(port: int) -> list[str]:
    """The command of a temporary API server on 127.0.0.1:``port`` (run it with :data:`TEMPORARY_SERVER_ENV`)."""
    return [
        *(sys.executable, "-m", "uvicorn", "--factory", TEMPORARY_SERVER_APP),
        *("--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"),
    ]


def runs_server_app(command_line: list[bytes]) -> bool:
    """Whether a process's arguments run Prefect's API app (a temporary server when its environment
    also holds :data:`EPHEMERAL_MARK`): Prefect's own temporary server or :func:`temporary_server_command`'s."""
    return TEMPORARY_SERVER_APP.encode() in command_line


# Result records: {"metadata": {"serializer": {...}, ...}, "result": "<the serialized value>"}.
# Prefect's JSON serializer writes an object as {"__class__": "<module.Qualname>", "data": ...} and an
# exception as {"__exc_type__": ..., "message": ...}; its decoder imports whatever those keys name.
ENCODED_TYPE_KEYS = ("__class__", "__exc_type__")


class ResultRecordParts(NamedTuple):
    serializer: Any  # the serializer's settings as the record names them (a dict if well-formed)
    result: Any  # the serialized value: a str for the JSON serializer


def result_record_parts(content: bytes) -> ResultRecordParts:
    """The serializer and the serialized value of a result record file, read as plain JSON (nothing
    decoded, nothing imported); ``ValueError`` when it is not a record of that layout."""
    try:
        record = json.loads(content)
        return ResultRecordParts(record["metadata"]["serializer"], record["result"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{type(error).__name__}: {error}") from None


def default_json_serializer() -> dict[str, Any]:
    """How a record names Prefect's default JSON serializer (``result_serializer="json"``)."""
    from prefect.serializers import JSONSerializer

    return JSONSerializer().model_dump(mode="json")


def encoded_object(value: Any) -> tuple[str, Any] | None:
    """``(qualified class name, data)`` when ``value`` is one object as the JSON serializer encodes it
    (those two keys and nothing else), else None."""
    if isinstance(value, dict) and set(value) == {"__class__", "data"} and isinstance(value["__class__"], str):
        return value["__class__"], value["data"]
    return None


def run_build_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The outputs of a deployment's build steps, by step id, as ``prefect deploy`` runs them (quietly)."""
    from prefect.deployments.steps.core import run_steps

    return asyncio.run(run_steps(steps, print_function=lambda *args, **kwargs: None)) if steps else {}


def apply_step_outputs(template: Any, outputs: dict[str, Any]) -> Any:
    """``template`` with its ``{{ step-id.key }}`` placeholders filled from ``outputs``, as ``prefect deploy`` does."""
    from prefect.utilities.templating import apply_values

    return apply_values(template, outputs)
