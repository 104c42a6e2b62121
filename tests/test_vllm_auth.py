"""The vLLM server's token (:mod:`trainers.generation.server_auth`) and ``alignflow vllm-server``'s refusal to
start without one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from infra.ops.service_cli import vllm_server_command
from trainers.generation.server_auth import (
    MIN_TOKEN_CHARS,
    TOKEN_VARIABLE,
    authorized,
    bearer,
    environment_token,
    new_token,
)

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


def test_a_managed_servers_gpus_must_be_none_of_the_training_processes():
    """``grpo.vllm_server_gpus`` that overlap cuda:0..num_processes-1 are a config error naming both
    fields; GPUs of its own load and become the server's CUDA_VISIBLE_DEVICES."""
    from pydantic import ValidationError

    from infra.core.config import load_config
    from infra.core.generation_server import server_devices

    served = ["stages=[sft, grpo]", "grpo.generation_backend=vllm", "grpo.vllm_mode=server", "compute.num_processes=2"]
    with pytest.raises(ValidationError) as refused:
        load_config(None, [*served, "grpo.vllm_server_gpus=[1, 2]"])
    assert (
        "grpo: vllm_server_gpus [1, 2]: GPU 1 also trains (compute.num_processes 2 uses GPUs 0 to 1); give the "
        "server GPUs from 2 on"
    ) in str(refused.value)
    config = load_config(None, [*served, "grpo.vllm_server_gpus=[2, 3]"])
    assert config.grpo.vllm_server_gpus == [2, 3]
    assert server_devices(config.grpo.vllm_server_gpus) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert server_devices(None) == {}
