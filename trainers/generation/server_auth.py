"""The vLLM server's secret (:mod:`trainers.generation.vllm_server`): one random token that the server and its
clients both take from the environment (:data:`TOKEN_VARIABLE`), never from a command line, a
config or a log. Every request carries it as ``Authorization: Bearer <token>``; the weight channel's
per-channel secret is handed only to a request that carried it (:mod:`trainers.generation.weight_channel`).
"""

from __future__ import annotations

import hmac
import os
import secrets

TOKEN_VARIABLE = "ALIGNFLOW_VLLM_TOKEN"
MIN_TOKEN_CHARS = 32  # token_urlsafe(32) gives 43


def new_token() -> str:
    return secrets.token_urlsafe(32)


def environment_token() -> str:
    """The token in this process's environment; a one-line error naming the variable without one."""
    token = os.environ.get(TOKEN_VARIABLE, "")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{TOKEN_VARIABLE} is {'too short' if token else 'not set'}: the vLLM server and its trainers share a "
            f'random token of at least {MIN_TOKEN_CHARS} characters (export {TOKEN_VARIABLE}="$(python -c '
            "'import secrets; print(secrets.token_urlsafe(32))')\" on both sides)"
        )
    return token


def bearer(token: str) -> dict[str, str]:
    """The header a client sends."""
    return {"Authorization": f"Bearer {token}"}


def authorized(header: str | None, token: str) -> bool:
    """Whether a request's ``Authorization`` header carries ``token`` (compared in constant time)."""
    scheme, _, presented = (header or "").partition(" ")
    return scheme == "Bearer" and hmac.compare_digest(presented.encode(), token.encode())
