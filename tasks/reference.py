"""Reference log-probs: one frozen forward pass over the preference pairs, cached by content."""

from __future__ import annotations

import json
import time

import datasets
from prefect import task

from infra.config import ReferenceConfig
from infra.settings import get_settings
from tasks.fingerprints import atomic_directory, hash_value
from tasks.refs import ModelRef, PreparedData, RefLogps
from trainers.logprobs import LOGPROB_CODE_VERSION
from trainers.modeling import load_causal_lm
from trainers.reference import reference_logps

PREFERENCE_SPLITS = ("preference", "preference_eval")
REFERENCE_DTYPE = "float32"
MANIFEST = "manifest.json"


def reference_key(data: PreparedData, reference: ModelRef) -> str:
    """Content key: tokenized data, reference weights and tokenizer, log-prob code and dtype."""
    return hash_value(
        {
            "data": data.fingerprint,
            "reference": reference.fingerprint,
            "tokenizer": reference.tokenizer_fingerprint,
            "code": LOGPROB_CODE_VERSION,
            "dtype": REFERENCE_DTYPE,
        }
    )


def reference_cache_key(context, parameters) -> str:
    return "reference-" + reference_key(parameters["data"], parameters["reference"])


@task(name="cache-reference-logps", cache_key_fn=reference_cache_key, persist_result=True)
def cache_ref_logps(data: PreparedData, reference: ModelRef, config: ReferenceConfig) -> RefLogps:
    """Store ``ref_chosen_logps`` / ``ref_rejected_logps`` columns next to the prepared pairs."""
    key = reference_key(data, reference)
    target = get_settings().reference_cache / key
    if not (target / MANIFEST).exists():
        model, tokenizer = load_causal_lm(reference.path, reference.revision)
        prepared = datasets.load_from_disk(data.path)
        started = time.perf_counter()
        with_ref = {}
        for split in PREFERENCE_SPLITS:
            if split in prepared:
                chosen, rejected = reference_logps(model, tokenizer.pad_token_id, prepared[split].to_list(), config.batch_size)
                with_ref[split] = prepared[split].add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)
        seconds = time.perf_counter() - started
        with atomic_directory(target) as staging:
            datasets.DatasetDict(with_ref).save_to_disk(staging / "data")
            manifest = {"rows": {s: len(d) for s, d in with_ref.items()}, "seconds": seconds, "reference": reference.path, "data": data.fingerprint}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    manifest = json.loads((target / MANIFEST).read_text())
    return RefLogps(key=key, path=str(target / "data"), reference_fingerprint=reference.fingerprint, rows=manifest["rows"])
