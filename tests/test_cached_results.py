"""Prefect's cached results (tasks/results.py): JSON records of handles with state-folder-relative
paths. A record that could run code is never decoded; one whose files are gone or changed is
recomputed, with a warning; a copied state folder uses its own models and writes nothing into the
original (its MLflow store's artifact locations are moved with it)."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path

import pytest
from helpers import MINIMAL, run_flow, task_states
from killing import latest_flow_run_id, mlflow_client, run
from prefect.results import ResultRecord
from prefect.serializers import JSONSerializer, PickleSerializer

from infra.core.config import ComputeConfig, EvaluationConfig, load_config
from infra.core.handles import HOME, ModelHandle, PreparedData
from infra.core.settings import get_settings
from tasks.results import RESULTS, RejectedResult, parse_record, validate_record

SFT_ONLY = ["stages=[sft]", "evaluation.num_prompts=4"]


def record(result: str, serializer: dict | None = None) -> bytes:
    """A result record as Prefect writes it: metadata naming the serializer, and the serialized result."""
    serializer = serializer or JSONSerializer().model_dump(mode="json")
    return json.dumps({"metadata": {"serializer": serializer, "expiration": None}, "result": result}).encode()


def handle_json(handle) -> str:
    return json.dumps({"__class__": "infra.core.handles.ModelHandle", "data": handle.model_dump(mode="json")})


MODEL = ModelHandle(path="org/model", fingerprint="f", tokenizer_fingerprint="t", stage="base")


@pytest.mark.unit
def test_a_json_record_of_a_handle_is_parsed_as_plain_data():
    assert parse_record(record(handle_json(MODEL))) == MODEL


class Touch:
    """Unpickling this creates a file: the stand-in for code an attacker would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


TAMPERED = {
    "pickle": lambda marker: record(
        PickleSerializer(picklelib="pickle").dumps(Touch(marker)).decode(),
        PickleSerializer(picklelib="pickle").model_dump(mode="json"),
    ),
    "json-with-another-decoder": lambda marker: record(
        handle_json(MODEL), JSONSerializer().model_dump(mode="json") | {"object_decoder": "builtins.print"}
    ),
    "unknown-class": lambda marker: record(json.dumps({"__class__": "pathlib.Path", "data": str(marker)})),
    "nested-class": lambda marker: record(
        json.dumps(
            {
                "__class__": "infra.core.handles.ModelHandle",
                "data": MODEL.model_dump(mode="json") | {"revision": {"__class__": "pathlib.Path", "data": "x"}},
            }
        )
    ),
    "not-json": lambda marker: b"\x80\x04K\x01.",
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_record_that_prefect_would_decode_by_importing_or_unpickling_is_rejected(case, tmp_path):
    with pytest.raises(RejectedResult):
        parse_record(TAMPERED[case](tmp_path / "ran"))
    assert not (tmp_path / "ran").exists()


@pytest.mark.unit
def test_paths_below_the_state_folder_are_stored_relative_to_it_and_resolved_on_use(monkeypatch, tmp_path):
    root = get_settings().root
    data = PreparedData(
        path=str(root / "cache/data/x/data"), fingerprint="x", rows={}, dropped={}, token_fingerprints={}, truncation={}
    )
    stored = data.model_dump(mode="json")
    assert stored["path"] == f"{HOME}/cache/data/x/data"
    assert MODEL.model_dump(mode="json")["path"] == "org/model"  # a hub id stays as it is
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "copy"))  # a copied state folder reads it
    assert PreparedData.model_validate(stored).path == str(tmp_path / "copy" / "cache/data/x/data")


@pytest.mark.unit
def test_validation_moves_a_rejected_record_aside_with_a_warning(tmp_path, caplog):
    (tmp_path / "key").write_bytes(TAMPERED["pickle"](tmp_path / "ran"))
    (tmp_path / "kept").write_bytes(record(handle_json(MODEL)))
    with caplog.at_level(logging.WARNING, logger="alignflow.results"):
        validate_record("key", tmp_path)
        validate_record("kept", tmp_path)
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["kept", "key.rejected"]
    assert "cached result key is not used and is computed again: written with serializer" in caplog.text
    assert not (tmp_path / "ran").exists()


@pytest.fixture
def fresh_sft(prefect_api_url):
    """Run an SFT-only flow with a seed no other test uses; its config and its new result record."""

    def run(seed: int, *overrides: str):
        before = set(RESULTS.glob("train-sft-*"))
        config = load_config(MINIMAL, [*SFT_ONLY, f"sft.seed={seed}", *overrides])
        run_flow(config)
        (path,) = set(RESULTS.glob("train-sft-*")) - before
        return config, path

    return run


def rejected(path: Path) -> list[Path]:
    return list(path.parent.glob(f"{path.name}.rejected-*"))


@pytest.mark.flow
def test_a_tampered_result_is_never_run_and_is_computed_again(fresh_sft, tmp_path):
    config, path = fresh_sft(21)
    handle = parse_record(path.read_bytes())
    marker = tmp_path / "ran"
    path.write_bytes(TAMPERED["pickle"](marker))
    ResultRecord.deserialize(path.read_bytes())  # what Prefect does with it on a cache hit: it runs the payload
    assert marker.exists()
    marker.unlink()

    flow_run_id, _ = run_flow(config)
    assert not marker.exists()
    assert task_states(flow_run_id)["train-sft"] == "Completed"  # not Cached: computed (from its output folder)
    assert parse_record(path.read_bytes()) == handle  # a JSON record again, of the same model
    assert len(rejected(path)) == 1


@pytest.mark.flow
def test_a_cached_model_whose_folder_was_removed_is_trained_again(fresh_sft):
    config, path = fresh_sft(22)
    handle = parse_record(path.read_bytes())
    shutil.rmtree(Path(handle.path).parent)  # the stage's output folder (as `rm -r outputs/` does)
    flow_run_id, _ = run_flow(config)
    assert task_states(flow_run_id)["train-sft"] == "Completed"
    assert len(rejected(path)) == 1
    again = parse_record(path.read_bytes())
    assert Path(again.path).is_dir() and again.fingerprint == handle.fingerprint  # the same model, retrained
    assert again.mlflow_run_id != handle.mlflow_run_id


@pytest.mark.flow
def test_a_cached_model_whose_weights_changed_is_saved_again_from_its_last_checkpoint(fresh_sft):
    config, path = fresh_sft(23, "tracking.keep_checkpoints=true")  # else a finished stage's are pruned
    handle = parse_record(path.read_bytes())
    weights = Path(handle.path) / "model.safetensors"
    content = bytearray(weights.read_bytes())
    content[-1] ^= 0xFF
    weights.write_bytes(bytes(content))
    flow_run_id, _ = run_flow(config)
    assert task_states(flow_run_id)["train-sft"] == "Completed"
    assert len(rejected(path)) == 1
    assert parse_record(path.read_bytes()) == handle  # same fingerprint, same MLflow run
    tags = mlflow_client(get_settings().root).get_run(handle.mlflow_run_id).data.tags
    assert tags["alignflow.resumed_from_step"] == "6"  # the final checkpoint: nothing retrained


@pytest.mark.flow
def test_a_copied_state_folder_uses_its_own_models(prefect_api_url, tmp_path):
    original, copy = tmp_path / "original", tmp_path / "copy"
    overrides = ["stages=[sft, dpo]", "evaluation.num_prompts=4", "sft.seed=24"]
    run(Path(MINIMAL), original, prefect_api_url, overrides)
    shutil.copytree(original, copy)
    shutil.rmtree(original / "outputs")  # were the copy to use the original's models, it would find none
    before = {p: p.stat().st_mtime_ns for p in original.rglob("*")}
    result = run(Path(MINIMAL), copy, prefect_api_url, overrides)
    assert {p: p.stat().st_mtime_ns for p in original.rglob("*")} == before  # nothing written into the original
    copied = mlflow_client(copy)
    experiments = [e.experiment_id for e in copied.search_experiments()]
    (dpo_run,) = copied.search_runs(experiments, "tags.alignflow.stage = 'dpo'")
    assert dpo_run.info.artifact_uri.startswith(f"{copy.as_uri()}/mlartifacts/")
    states = task_states(latest_flow_run_id(copy))
    assert states["train-sft"] == "Cached" and states["train-dpo"] == "Completed"
    assert "is not used and is computed again" not in result.stdout + result.stderr
    assert not (original / "outputs").exists()
    (finished,) = (copy / "outputs" / "minimal").glob("dpo-*/model.json")
    assert json.loads(finished.read_text())["path"].startswith(f"{HOME}/outputs/minimal/dpo-")


@pytest.mark.unit
def test_the_models_the_evaluation_cache_lacks_are_scored_together_once_per_key(state_dir, monkeypatch):
    """One call of score_models for the models without an entry (one launch over several processes),
    a key shared by two labels scored once; the scores come back in the models' order."""
    from prefect.logging import disable_run_logger

    from tasks import evaluate

    calls = []

    def score_models(handles, *args):
        calls.append([h.stage for h in handles])
        return (evaluate.ModelScores({"accuracy": len(h.stage) / 10}, {}, {}) for h in handles)

    monkeypatch.setattr(evaluate, "score_models", score_models)
    scoring = evaluate.Scoring([], None, EvaluationConfig(), None, ComputeConfig())
    base, sft, dpo = (MODEL.model_copy(update={"stage": stage}) for stage in ("base", "sft", "dpo"))
    keys = {stage: f"together-{stage}-{uuid.uuid4().hex}" for stage in ("base", "sft", "dpo")}
    with disable_run_logger():
        evaluate.cached_scores([sft], scoring, [keys["sft"]])
        scores = evaluate.cached_scores(
            [base, sft, dpo, base], scoring, [keys["base"], keys["sft"], keys["dpo"], keys["base"]]
        )
    assert calls == [["sft"], ["base", "dpo"]]
    assert [s.metrics["accuracy"] for s in scores] == [0.4, 0.3, 0.3, 0.4]


@pytest.mark.unit
def test_an_evaluation_cache_entry_changed_since_it_was_written_is_scored_again(state_dir, monkeypatch):
    """The cache's scores feed every model's row and the promotion gate: one edited on disk is not trusted."""
    from prefect.logging import disable_run_logger

    from tasks import evaluate

    scored = []

    def score_models(handles, *args):
        scored.extend(handles)
        return (evaluate.ModelScores({"accuracy": 0.25}, {"prompt": ["1+1="]}, {"correct": [0.25]}) for _ in handles)

    monkeypatch.setattr(evaluate, "score_models", score_models)
    key = f"integrity-{uuid.uuid4().hex}"
    scoring = evaluate.Scoring([], None, EvaluationConfig(), None, ComputeConfig())
    with disable_run_logger():
        (first,) = evaluate.cached_scores([MODEL], scoring, [key])
        assert evaluate.cached_scores([MODEL], scoring, [key]) == [first] and len(scored) == 1
        entry = get_settings().eval_cache / key / evaluate.SCORES_FILE
        entry.write_text(entry.read_text().replace("0.25}", "0.95}", 1))  # the accuracy, edited
        with pytest.raises(ValueError, match="scores.json does not match its sha256: changed since it was written"):
            evaluate.read_scores(entry)
        assert evaluate.cached_scores([MODEL], scoring, [key]) == [first] and len(scored) == 2
    assert evaluate.read_scores(entry) == first
