"""The contracts of infra.core.prefect_compat and infra.core.mlflow_compat: the installed Prefect and
MLflow are within the ranges those modules support (pyproject.toml's), and every internal they rely
on still exists and behaves as they assume. When Prefect or MLflow moves, a test here says which."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path, PurePosixPath

import pytest
import tomllib
from helpers import NEEDS_AUTH_MLFLOW
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from infra.core import mlflow_compat, prefect_compat
from infra.core.handles import ModelHandle
from infra.core.ports import free_port

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
MODEL = ModelHandle(path="org/model", fingerprint="f", tokenizer_fingerprint="t", stage="sft")


@pytest.mark.unit
@pytest.mark.parametrize("package, module", [("prefect", prefect_compat), ("mlflow", mlflow_compat)])
def test_the_installed_version_is_within_the_supported_range_which_is_pyprojects(package, module):
    low, high = module.SUPPORTED
    assert Version(low) <= Version(importlib.metadata.version(package)) < Version(high)
    dependencies = [Requirement(line) for line in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]
    (declared,) = [requirement.specifier for requirement in dependencies if requirement.name == package]
    assert declared == SpecifierSet(f">={low},<{high}")


# Prefect: the temporary server


@pytest.mark.slow
def test_the_temporary_server_runs_as_prefects_own_subprocess_server(monkeypatch):
    """The same app, options and private variables as ``SubprocessASGIServer`` (Popen caught, nothing starts)."""
    from prefect.server.api import server

    started = []
    monkeypatch.setattr(server.subprocess, "Popen", lambda args, env, **kwargs: started.append((args, env)))
    port = free_port()
    server.SubprocessASGIServer(port=port)._run_uvicorn_command()
    ((args, env),) = started
    app_dir = args.index("--app-dir")  # Prefect's own package folder: on the path of ours anyway
    assert args[:app_dir] + args[app_dir + 2 :] == prefect_compat.temporary_server_command(port)
    assert {name: env[name] for name in prefect_compat.TEMPORARY_SERVER_ENV} == prefect_compat.TEMPORARY_SERVER_ENV
    assert prefect_compat.EPHEMERAL_MARK.decode() in {f"{name}={value}" for name, value in env.items()}


@pytest.mark.slow  # imports Prefect's server app: seconds, out of the quick loop
def test_the_app_factory_exists_and_reads_the_private_variables():
    from prefect.server.api import server

    module, name = prefect_compat.TEMPORARY_SERVER_APP.split(":")
    assert getattr(importlib.import_module(module), name) is server.create_app
    source = inspect.getsource(server.create_app)
    for variable in ("PREFECT__SERVER_EPHEMERAL", "PREFECT__SERVER_FINAL"):
        assert f'os.getenv("{variable}")' in source


@pytest.mark.unit
def test_a_temporary_servers_arguments_are_told_from_others():
    command = [argument.encode() for argument in prefect_compat.temporary_server_command(4200)]
    assert prefect_compat.runs_server_app(command)
    assert not prefect_compat.runs_server_app([b"python", b"-m", b"prefect", b"server", b"start"])


# Prefect: result records


@pytest.mark.unit
def test_a_record_written_by_prefects_serializer_reads_back_as_plain_parts():
    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import JSONSerializer

    metadata = ResultRecordMetadata(serializer=JSONSerializer(), storage_key="key")
    content = ResultRecord(metadata=metadata, result=MODEL).serialize()
    parts = prefect_compat.result_record_parts(content)
    assert parts.serializer == prefect_compat.default_json_serializer() == {"type": "json"} | parts.serializer
    assert prefect_compat.encoded_object(json.loads(parts.result)) == (
        "infra.core.handles.ModelHandle",
        MODEL.model_dump(mode="json"),
    )
    assert ResultRecord.deserialize(content).result == MODEL  # Prefect's own reading agrees


@pytest.mark.unit
def test_the_json_serializer_encodes_and_imports_objects_by_the_keys_the_reader_refuses():
    from prefect.serializers import JSONSerializer

    encoded = json.loads(JSONSerializer().dumps({"error": ValueError("x"), "model": MODEL}))
    assert "__exc_type__" in encoded["error"] and set(prefect_compat.ENCODED_TYPE_KEYS) == {"__class__", "__exc_type__"}
    assert prefect_compat.encoded_object(encoded["model"])[0] == "infra.core.handles.ModelHandle"
    imported = JSONSerializer().loads(json.dumps({"__class__": "pathlib.PurePosixPath", "data": "x"}).encode())
    assert imported == PurePosixPath("x")  # the decoder imports what "__class__" names: why it never reads a record


@pytest.mark.parametrize(
    "content",
    [b"\x80\x04K\x01.", b"[]", json.dumps({"result": "1"}).encode(), json.dumps({"metadata": {}}).encode()],
)
@pytest.mark.unit
def test_what_is_not_a_record_of_that_layout_is_a_value_error(content):
    with pytest.raises(ValueError):
        prefect_compat.result_record_parts(content)


@pytest.mark.unit
def test_only_exactly_one_encoded_object_is_one():
    assert prefect_compat.encoded_object({"__class__": "a.B", "data": 1}) == ("a.B", 1)
    for value in ({"__class__": "a.B", "data": 1, "x": 2}, {"__class__": ["a"], "data": 1}, [1], "a.B"):
        assert prefect_compat.encoded_object(value) is None


# Prefect: deployment build steps


@pytest.mark.unit
def test_build_steps_resolve_parameters_as_prefect_deploy_runs_them():
    from prefect.cli.deploy import _core
    from prefect.deployments.steps.core import run_steps
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert "print_function" in inspect.signature(run_steps).parameters
    assert _core.run_steps is run_steps  # what `prefect deploy` runs its build steps with
    step = {"infra.ops.deployments.config_parameters": {"id": "c", "path": "configs/minimal.yaml", "overrides": []}}
    # A step's client is asked only for the blocks and variables it names (none): an API where nothing
    # listens keeps Prefect from starting a temporary server of its own.
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        outputs = prefect_compat.run_build_steps([step])
    assert outputs["c"]["config"]["name"] == "minimal"
    resolved = prefect_compat.apply_step_outputs({"config": "{{ c.config }}", "n": 1}, outputs)
    assert resolved == {"config": outputs["c"]["config"], "n": 1}
    assert prefect_compat.run_build_steps([]) == {}


# MLflow


@pytest.mark.unit
def test_the_rest_helper_still_takes_what_rest_poster_passes():
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    parameters = inspect.signature(http_request).parameters
    assert list(parameters)[:3] == ["host_creds", "endpoint", "method"]
    assert {"max_retries", "timeout", "raise_on_status"} <= set(parameters)
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # json= reaches requests
    assert get_default_host_creds("http://127.0.0.1:1").host == "http://127.0.0.1:1"


class Answers503(BaseHTTPRequestHandler):
    requests: list[dict] = []

    def do_POST(self):
        Answers503.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.unit
def test_a_post_is_sent_once_and_returns_any_answer():
    """No retries of a 503 (MLflow's client retries it for minutes): the answer comes back at once."""
    stub = HTTPServer(("127.0.0.1", 0), Answers503)  # in this process, on a thread
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        post = mlflow_compat.rest_poster(f"http://127.0.0.1:{stub.server_port}", timeout=5)
        body = {"run_id": "r", "metrics": []}
        assert post(mlflow_compat.LOG_BATCH_ENDPOINT, body).status_code == 503
        assert Answers503.requests == [body]
    finally:
        stub.shutdown()
        stub.server_close()


@pytest.mark.unit
def test_a_post_to_a_server_that_does_not_answer_raises_mlflow_exception_at_once():
    from mlflow.exceptions import MlflowException

    post = mlflow_compat.rest_poster(f"http://127.0.0.1:{free_port()}", timeout=5)
    started = time.monotonic()
    with pytest.raises(MlflowException):
        post(mlflow_compat.LOG_BATCH_ENDPOINT, {"run_id": "r", "metrics": []})
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_the_default_allowed_hosts_hold_localhost_and_private_networks():
    hosts = mlflow_compat.default_allowed_hosts()
    assert {"localhost", "127.0.0.1", "10.*", "192.168.*"} <= set(hosts) and all(isinstance(h, str) for h in hosts)


@pytest.mark.unit
def test_the_dataset_context_tag_is_mlflows():
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    assert mlflow_compat.DATASET_CONTEXT_TAG == MLFLOW_DATASET_CONTEXT


@pytest.mark.unit
def test_the_tracking_schemes_are_those_mlflows_stores_register_and_are_read_as_mlflow_reads_them():
    from mlflow.store.db.db_types import DATABASE_ENGINES
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    from mlflow.utils.uri import get_uri_scheme

    refused_as_tracking = {"databricks-uc", "uc"}  # registered; their builder refuses them
    assert set(mlflow_compat.tracking_schemes()) | refused_as_tracking == set(_tracking_store_registry._registry)
    assert set(mlflow_compat.DATABASE_SCHEMES) == set(DATABASE_ENGINES)
    uris = ["sqlite:////a.db", "postgresql+psycopg2://u@h/d", "mssql+pyodbc://h/d", "/a/mlruns", "file:///a"]
    uris += ["https://h:1/p", "C:\\mlruns", "databricks", "databricks://profile", "foo://bar", "S3://b"]
    # as mlflow.tracking.registry.StoreRegistry.get_store_builder picks the store
    mlflows = [uri if uri in {"databricks", *refused_as_tracking} else get_uri_scheme(uri) for uri in uris]
    assert [mlflow_compat.tracking_uri_scheme(uri) for uri in uris] == mlflows


def auth_config_read_by_mlflow(monkeypatch, settings: Path | None):
    """MLflow's basic-auth settings as its app reads them, with the admin in the environment as
    ``servers up --auth`` gives it, from ``settings`` (None: the file MLflow ships)."""
    from mlflow.server.auth.config import read_auth_config

    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_USERNAME", "alignflow")
    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", "secret")
    if settings is None:
        monkeypatch.delenv("MLFLOW_AUTH_CONFIG_PATH", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(settings))
    return read_auth_config()


@pytest.mark.unit
def test_servers_up_refuses_auth_exactly_on_an_mlflow_that_takes_its_admin_from_its_settings_file(monkeypatch):
    shipped = auth_config_read_by_mlflow(monkeypatch, None)
    taken = (shipped.admin_username, shipped.admin_password) == ("alignflow", "secret")
    assert mlflow_compat.basic_auth_admin_from_environment(mlflow_compat.installed_version()) == taken


@pytest.mark.unit
@NEEDS_AUTH_MLFLOW
def test_the_basic_auth_settings_are_mlflows_own_but_for_the_credential_cache(tmp_path, monkeypatch):
    """Read by MLflow as the basic-auth app reads them: what MLflow ships, with the cache switched on."""
    shipped = auth_config_read_by_mlflow(monkeypatch, None)
    (tmp_path / "auth.ini").write_text(mlflow_compat.basic_auth_config(60))
    ours = auth_config_read_by_mlflow(monkeypatch, tmp_path / "auth.ini")
    assert (shipped.auth_cache_ttl_seconds, ours.auth_cache_ttl_seconds) == (0, 60)
    assert ours._replace(auth_cache_ttl_seconds=0) == shipped


@pytest.mark.unit
@pytest.mark.parametrize("version, taken", [("3.9.0", False), ("3.16.1", False), ("3.17.0", True), ("3.17.2", True)])
def test_mlflow_takes_the_basic_auth_admin_from_the_environment_from_3_17_on(version, taken):
    """3.9.0 and 3.16.0 read ``admin_username``/``admin_password`` from the settings file only (read in
    their wheels' mlflow/server/auth/config.py); 3.17.0 reads MLFLOW_AUTH_ADMIN_* first."""
    assert mlflow_compat.basic_auth_admin_from_environment(version) is taken


@pytest.mark.unit
def test_deleting_artifacts_removes_that_path_only(tmp_path):
    for name in ("checkpoints/step-1/weights", "model/weights"):
        (tmp_path / name).parent.mkdir(parents=True)
        (tmp_path / name).write_text("w")
    mlflow_compat.delete_artifacts(tmp_path.as_uri(), "checkpoints")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["model", "model/weights"]


@pytest.mark.slow
def test_relocating_a_copied_sqlite_store_points_every_artifact_uri_into_the_copy(tmp_path):
    """A run's artifacts, its experiment's location, a logged model and a registered version of a
    store copied to another folder resolve, and are written, under the copy once relocated; the
    original may be gone. The columns are MLflow's schema, which a new MLflow may change."""
    import shutil
    import subprocess
    import sys

    from mlflow import MlflowClient

    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    client = MlflowClient(f"sqlite:///{original / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(original / "mlartifacts" / "e").as_uri())
    run = client.create_run(experiment)
    (tmp_path / "weights.txt").write_text("w")
    client.log_artifact(run.info.run_id, str(tmp_path / "weights.txt"), "model")
    client.create_logged_model(experiment, source_run_id=run.info.run_id)
    client.create_registered_model("m")
    client.create_model_version("m", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    shutil.copytree(original, copy)
    shutil.rmtree(original)

    assert mlflow_compat.relocate_artifact_uris(copy / "mlflow.db", original.as_uri(), copy.as_uri()) == 5
    moved = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    below_copy = f"{copy.as_uri()}/mlartifacts/e/"
    assert moved.get_experiment(experiment).artifact_location == below_copy.rstrip("/")
    assert moved.get_run(run.info.run_id).info.artifact_uri.startswith(below_copy)
    (logged,) = moved.search_logged_models([experiment])
    assert logged.artifact_location.startswith(below_copy)
    version = moved.get_model_version("m", "1")
    assert version.source.startswith(below_copy)
    assert (copy / "mlflow.db").exists() and not original.exists()
    assert Path(moved.download_artifacts(run.info.run_id, "model/weights.txt", str(tmp_path))).read_text() == "w"
    # another process, as the next command is (MLflow keeps a run's artifact repository per process)
    client_of = f"from mlflow import MlflowClient; MlflowClient({moved.tracking_uri!r})"
    write = f"{client_of}.log_text({run.info.run_id!r}, 'a', 'x.txt')"
    subprocess.run([sys.executable, "-c", write], check=True)
    moved.log_text(moved.create_run(experiment).info.run_id, "a new run", "y.txt")
    assert not original.exists() and len(list(copy.glob("mlartifacts/e/*/artifacts/*.txt"))) == 2
    assert mlflow_compat.relocate_artifact_uris(copy / "mlflow.db", original.as_uri(), copy.as_uri()) == 0


@pytest.mark.unit
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_attention_implementation_and_its_packed_mask_builders_are_read_off_the_model(implementation):
    """``trainers.models.transformers_compat``: the config's resolved ``_attn_implementation``, through a
    peft wrapper, and the modeling modules that build masks with the packed-row-aware utilities."""
    import copy

    import peft
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from trainers.models.transformers_compat import (
        attention_implementation,
        classifier_parts,
        masks_from_positions,
        plain_output_head,
    )

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    llama = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation=implementation))
    wrapped = peft.get_peft_model(llama, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert attention_implementation(llama) == attention_implementation(wrapped) == implementation
    assert masks_from_positions(wrapped) and masks_from_positions(
        GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2))
    )
    assert not masks_from_positions(torch.nn.Linear(2, 2))
    classifier = LlamaForSequenceClassification(LlamaConfig(**shape, num_labels=1))
    backbone, head = classifier_parts(classifier)
    assert backbone is classifier.model and head is classifier.score
    with pytest.raises(TypeError, match="LlamaForCausalLM has no score head"):
        classifier_parts(llama)
    # the output projection the log-prob pass may apply itself: a plain Linear of a plain-head architecture
    assert plain_output_head(wrapped) is llama.lm_head
    assert plain_output_head(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2))) is None
    on_head = peft.get_peft_model(copy.deepcopy(llama), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    assert plain_output_head(on_head) is None


@pytest.mark.unit
def test_the_head_is_called_with_the_last_hidden_states_at_the_kept_positions():
    """``transformers_compat.head_inputs``: a causal LM calls its output head with the hidden states of the
    ``logits_to_keep`` positions as its first argument; kept, and the head applied to none of them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.models.transformers_compat import head_inputs

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    ids, keep = torch.randint(0, 64, (2, 7)), torch.tensor([1, 4, 5])
    with torch.no_grad():
        expected = model(input_ids=ids, logits_to_keep=keep).logits
        with head_inputs(model.lm_head) as captured:
            empty = model(input_ids=ids, logits_to_keep=keep).logits
        assert empty.shape == (2, 0, 64) and len(captured) == 1
        torch.testing.assert_close(model.lm_head(captured[0]), expected, rtol=0, atol=0)
        assert model(input_ids=ids, logits_to_keep=keep).logits.shape == (2, 3, 64)  # the hook is gone


@pytest.mark.unit
@pytest.mark.parametrize("processes, averaged", [(4, True), (4, False), (1, True)])
def test_the_window_loss_scale_is_the_factor_trainer_compute_loss_applies(tmp_path, monkeypatch, processes, averaged):
    """``transformers_compat.window_loss_scale`` against ``Trainer.compute_loss`` itself: what it multiplies
    a causal LM's loss over the window's ``num_items_in_batch`` by, with ``processes`` processes."""
    import accelerate
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from trainers.models.transformers_compat import window_loss_scale

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    arguments = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, average_tokens_across_devices=averaged
    )
    trainer = Trainer(model=model, args=arguments)
    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: processes))
    ids = torch.randint(0, 64, (2, 6))
    inputs = {"input_ids": ids, "labels": ids}
    items = torch.tensor(23)
    with torch.no_grad():
        window_mean = model(**inputs, num_items_in_batch=items).loss
        trainers_loss = Trainer.compute_loss(trainer, model, inputs, num_items_in_batch=items)
    assert window_loss_scale(trainer) == (processes if averaged else 1)
    torch.testing.assert_close(trainers_loss, window_mean * window_loss_scale(trainer), rtol=0, atol=0)


@pytest.mark.unit
def test_packed_rows_are_kept_apart_only_by_a_forward_without_a_kv_cache():
    """Why every packed forward passes ``use_cache=False``: transformers detects rows restarting in
    ``position_ids`` only where the forward builds no KV cache; with one (a causal LM's default) the
    packed rows attend to each other."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).eval()
    lengths = [5, 3, 4]
    ids = torch.randint(0, 64, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        rows = torch.cat([model(input_ids=row, use_cache=False).logits for row in ids.split(lengths, dim=1)], 1)
        apart = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        cached = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(apart, rows, rtol=1e-5, atol=1e-5)
    assert (cached - rows)[:, lengths[0] :].abs().max() > 1e-3  # the later rows see the first
