"""The vLLM server's token (:mod:`trainers.vllm_auth`) and ``alignflow vllm-server``'s refusal to
start without one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from infra.ops.service_cli import vllm_server_command
from trainers.vllm_auth import MIN_TOKEN_CHARS, TOKEN_VARIABLE, authorized, bearer, environment_token, new_token

pytestmark = pytest.mark.unit


def test_only_the_bearer_header_with_the_exact_token_is_authorized():
    token = new_token()
    assert len(token) >= MIN_TOKEN_CHARS and token != new_token()
    assert authorized(bearer(token)["Authorization"], token)
    for header in (None, "", token, f"Basic {token}", f"Bearer {token[:-1]}", f"Bearer {token}x", "Bearer "):
        assert not authorized(header, token), header


@pytest.mark.parametrize("value, why", [(None, "not set"), ("short", "too short")])
def test_no_token_in_the_environment_is_a_one_line_error_naming_the_variable(monkeypatch, capsys, value, why):
    if value is None:
        monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(TOKEN_VARIABLE, value)
    with pytest.raises(ValueError, match=f"^{TOKEN_VARIABLE} is {why}: "):
        environment_token()
    args = argparse.Namespace(host="127.0.0.1", port=0, weights_root=Path("/nonexistent"))
    assert vllm_server_command(args) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"alignflow vllm-server: {TOKEN_VARIABLE} is {why}: ") and error.count("\n") == 1
    monkeypatch.setenv(TOKEN_VARIABLE, "k" * MIN_TOKEN_CHARS)
    assert environment_token() == "k" * MIN_TOKEN_CHARS
