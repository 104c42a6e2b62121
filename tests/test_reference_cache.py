"""Reference log-prob caching as the pipeline uses it: the content key, values against the live
reference model, no forward pass on a hit, rebuilds of corrupt entries (task bodies, no server)."""

from __future__ import annotations

import json
import logging
import shutil

import datasets
import pyarrow as pa
import pytest
import torch
from prefect.logging import disable_run_logger

import trainers.scoring.reference_pass
from infra.core.config import AdditionTaskConfig, DataConfig, DatasetSource, ModelConfig, ReferenceConfig
from infra.core.refcache import CacheIntegrityError
from tasks.data import prepare_dataset
from tasks.models import checkpoint_handle, resolve_model
from tasks.reference import cache_ref_logps, reference_key, reference_key_inputs, with_reference_columns
from tasks.reference_columns import join_columns
from trainers.models.pretrained import load_causal_lm
from trainers.scoring.reference_views import PAIRS_VIEW

pytestmark = pytest.mark.unit

PAIRS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a, b in [(1, 2), (3, 4), (10, 5), (7, 7)]
]


@pytest.fixture(scope="module")
def base():
    return resolve_model.fn(ModelConfig())


def prepare(folder, pairs, tokenizer, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs))
    with disable_run_logger():
        return prepare_dataset.fn(
            DataConfig(builtin=None, preference=DatasetSource(path=str(path)), **fields), tokenizer
        )


def copy_checkpoint(source, target, edit=None):
    shutil.copytree(source, target)
    if edit is not None:
        edit(target)
    return checkpoint_handle(target, "base")


def change_one_weight(folder):
    model, _ = load_causal_lm(str(folder))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 5] += 1e-3
    model.save_pretrained(folder)


def change_chat_template(folder):
    """transformers saves the template as chat_template.jinja, which wins over the config's."""
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_key_misses_on_one_data_token_tokenizer_weight_or_max_length_and_nothing_else(tmp_path, base):
    data = prepare(tmp_path / "data", PAIRS, base)
    key = reference_key(data, base)

    one_token = [PAIRS[0] | {"rejected": "5"}, *PAIRS[1:]]  # "4" -> "5": one token of one completion
    assert reference_key(prepare(tmp_path / "token", one_token, base), base) != key
    assert reference_key(prepare(tmp_path / "max-length", PAIRS, base, max_length=33), base) != key
    assert reference_key(data, copy_checkpoint(base.path, tmp_path / "weight", change_one_weight)) != key
    assert reference_key(data, copy_checkpoint(base.path, tmp_path / "tokenizer", change_chat_template)) != key

    # Not in the key: other splits, and files that name runs or folders next to identical weights.
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    with_sft = prepare(tmp_path / "with-sft", PAIRS, base, sft=DatasetSource(path=str(sft)))
    assert with_sft.fingerprint != data.fingerprint and reference_key(with_sft, base) == key
    other_run = copy_checkpoint(
        base.path, tmp_path / "other-run", lambda f: (f / "training_args.bin").write_bytes(b"output_dir=run-42")
    )
    assert other_run.fingerprint != base.fingerprint and reference_key(data, other_run) == key


def live_completion_logp(model, row: dict, completion: str) -> float:
    """Sum of log p(completion token | prefix) for one unpadded sequence, computed here directly
    (``completion``: the row's ``<completion>_ids`` column)."""
    prompt, tokens = row["prompt_ids"], row[f"{completion}_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].double(), -1)
    return sum(logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens))


def test_cached_values_equal_the_live_reference_hits_run_no_forward_and_corruption_is_rebuilt(
    tmp_path, monkeypatch, base, caplog
):
    monkeypatch.setenv("ALIGNFLOW_REFERENCE_CACHE", str(tmp_path / "refcache"))
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=5, num_eval_problems=8)), base)
        ref = cache_ref_logps.fn(data, base, ReferenceConfig(batch_size=7))
    assert ref.root == str(tmp_path / "refcache") and ref.path == f"{ref.root}/{ref.key}"
    splits = with_reference_columns(ref)
    assert {name: len(split) for name, split in splits.items()} == {"preference": 28, "preference_eval": 8}

    model, _ = load_causal_lm(base.path)
    model.eval()
    for split in splits.values():
        for row in split:
            assert abs(row["ref_chosen_logps"] - live_completion_logp(model, row, "chosen")) <= 1e-5
            assert abs(row["ref_rejected_logps"] - live_completion_logp(model, row, "rejected")) <= 1e-5

    real = trainers.scoring.reference_pass.reference_logps
    calls = []
    monkeypatch.setattr(
        trainers.scoring.reference_pass, "reference_logps", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    with disable_run_logger():
        assert cache_ref_logps.fn(data, base, ReferenceConfig(batch_size=32)) == ref.model_copy(
            update={"batch_size": 32}
        )
    assert with_reference_columns(ref)["preference"]["ref_chosen_logps"] == splits["preference"]["ref_chosen_logps"]
    assert calls == []

    parquet = tmp_path / "refcache" / ref.key / "preference.parquet"
    parquet.write_bytes(parquet.read_bytes()[:-40])  # truncated
    with caplog.at_level(logging.WARNING, logger="alignflow.refcache"):
        rebuilt = with_reference_columns(ref)  # what the DPO and evaluate tasks read
    assert calls == [1, 1]  # both splits recomputed
    assert f"{ref.key} is unusable and will be rebuilt" in caplog.text and "preference.parquet" in caplog.text
    assert rebuilt["preference"]["ref_chosen_logps"] == splits["preference"]["ref_chosen_logps"]


def test_join_matches_rows_by_row_id_whatever_the_stored_order():
    import datasets

    split = datasets.Dataset.from_list([{"prompt_ids": [i]} for i in range(4)])
    table = pa.table(
        {
            "row_id": [2, 0, 3, 1],
            "ref_chosen_logps": [-2.0, -0.0, -3.0, -1.0],
            "ref_rejected_logps": [-20.0, -0.5, -30.0, -10.0],
        }
    )
    joined = join_columns(split, table, "entry", PAIRS_VIEW)
    assert joined["ref_chosen_logps"] == [-0.0, -1.0, -2.0, -3.0]
    assert joined["ref_rejected_logps"] == [-0.5, -10.0, -20.0, -30.0]
    with pytest.raises(CacheIntegrityError, match="entry: row ids are not exactly the 4 prepared rows"):
        join_columns(split, table.slice(0, 3), "entry", PAIRS_VIEW)


def test_the_kto_view_caches_each_completion_and_its_kl_completion_under_its_own_key(tmp_path, monkeypatch, base):
    """KTO's rows (the pairs unpaired, each with another row's completion as its KL completion) are
    scored by the reference pass and cached: both columns equal the live reference's log-probs, the
    key is not the pairs' key, and the trainer's rows are the ones scored."""
    from trainers.kto.data import kto_splits

    monkeypatch.setenv("ALIGNFLOW_REFERENCE_CACHE", str(tmp_path / "refcache"))
    with disable_run_logger():
        data = prepare_dataset.fn(DataConfig(builtin=AdditionTaskConfig(max_operand=5, num_eval_problems=8)), base)
        ref = cache_ref_logps.fn(data, base, ReferenceConfig(batch_size=7), view="kto")
    assert ref.view == "kto" and ref.key == reference_key(data, base, view="kto") != reference_key(data, base)
    assert reference_key_inputs(data, base, view="kto")["view"] == "kto"
    splits = with_reference_columns(ref)
    assert {name: len(split) for name, split in splits.items()} == {"kto": 56, "kto_eval": 16}
    live_rows = kto_splits(datasets.load_from_disk(data.path))
    model, _ = load_causal_lm(base.path)
    model.eval()
    for name, split in splits.items():
        assert [{k: v for k, v in row.items() if not k.startswith("ref_")} for row in split] == live_rows[name]
        for row in split:
            assert abs(row["ref_logps"] - live_completion_logp(model, row, "completion")) <= 1e-5
            assert abs(row["ref_kl_logps"] - live_completion_logp(model, row, "kl_completion")) <= 1e-5
