"""A tokenizer's fingerprint follows what it does: ``save_pretrained`` round trips and rewrites of
its files in older or newer forms keep it; a change to what tokenization gives changes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import CHATML
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tasks.models import tokenizer_fingerprint

pytestmark = pytest.mark.unit

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained here (merges and all) with ChatML, saved once."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog, 12345", "hello world"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    folder = tmp_path_factory.mktemp("tokenizer") / "base"
    tokenizer.save_pretrained(folder)
    return folder


def rewritten(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    edit(target)
    return target


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=4))


def test_save_pretrained_round_trips_and_older_file_forms_keep_the_fingerprint(saved, tmp_path):
    AutoTokenizer.from_pretrained(saved).save_pretrained(tmp_path / "round-trip")  # adds is_local, …
    assert (tmp_path / "round-trip" / "tokenizer_config.json").read_bytes() != (
        saved / "tokenizer_config.json"
    ).read_bytes()

    def older_forms(folder: Path) -> None:
        edit_json(
            folder / "tokenizer.json", lambda d: d["model"].update(merges=[" ".join(m) for m in d["model"]["merges"]])
        )
        edit_json(
            folder / "tokenizer_config.json",
            lambda d: d.update(tokenizer_class="PreTrainedTokenizerFast", is_local=True),
        )
        template = (folder / "chat_template.jinja").read_text()
        (folder / "chat_template.jinja").unlink()  # the template inside the config, as older versions save it
        edit_json(folder / "tokenizer_config.json", lambda d: d.update(chat_template=template, padding_side="right"))
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))

    older = rewritten(saved, tmp_path / "older", older_forms)
    assert len({tokenizer_fingerprint(f) for f in (saved, tmp_path / "round-trip", older)}) == 1


def drop_last_merge(folder: Path) -> None:
    edit_json(folder / "tokenizer.json", lambda d: d["model"].update(merges=d["model"]["merges"][:-1]))


def other_template(folder: Path) -> None:
    (folder / "chat_template.jinja").write_text(CHATML.replace("<|im_end|>\n", "<|im_end|>"))


def other_eos(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", lambda d: d.update(eos_token="<|im_end|>"))


def left_padding(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", lambda d: d.update(padding_side="left"))


def lowercase(folder: Path) -> None:
    edit_json(folder / "tokenizer.json", lambda d: d.update(normalizer={"type": "Lowercase"}))


def test_a_tokenizer_is_fingerprinted_as_transformers_loads_it(saved, tmp_path):
    """A folder whose config.json names a Qwen2 model loads as Qwen2Tokenizer, which brings its own
    pre-tokenizer (digits one by one) and NFC normalizer: not what tokenizer.json alone does. The
    stages save it back as what it loaded as; the base and its fine-tune compare equal."""
    from transformers import Qwen2Config

    qwen = rewritten(saved, tmp_path / "qwen", lambda folder: Qwen2Config().save_pretrained(folder))
    loaded = AutoTokenizer.from_pretrained(qwen)
    assert type(loaded).__name__ == "Qwen2Tokenizer" and len(loaded("12345").input_ids) == 5
    assert tokenizer_fingerprint(qwen) != tokenizer_fingerprint(saved)
    loaded.save_pretrained(tmp_path / "fine-tuned")
    Qwen2Config().save_pretrained(tmp_path / "fine-tuned")
    assert tokenizer_fingerprint(tmp_path / "fine-tuned") == tokenizer_fingerprint(qwen)


@pytest.mark.parametrize("change", [drop_last_merge, other_template, other_eos, left_padding, lowercase])
def test_a_change_to_what_tokenization_gives_changes_the_fingerprint(saved, tmp_path, change):
    assert tokenizer_fingerprint(rewritten(saved, tmp_path / "changed", change)) != tokenizer_fingerprint(saved)


def hub_cache(root: Path, repo: str, files: Path, commit: str = "0" * 40) -> Path:
    """A Hugging Face cache holding ``repo`` at ``commit`` (its main) with the files of ``files``:
    what a download leaves, so a hub id resolves offline."""
    storage = root / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    shutil.copytree(files, storage / "snapshots" / commit)
    return root


def test_a_hub_models_tokenizer_fingerprint_equals_its_fine_tunes(saved, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from infra.core.config import ModelConfig
    from tasks.models import model_handle

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "acme/chat", saved)))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here: the cache answers
    AutoTokenizer.from_pretrained(saved).save_pretrained(tmp_path / "fine-tuned")  # as a stage saves it
    hub = model_handle(ModelConfig(source="acme/chat"))
    assert hub.tokenizer_fingerprint == tokenizer_fingerprint(tmp_path / "fine-tuned")
    assert (hub.path, hub.source) == ("acme/chat", "acme/chat")
    # a hub id whose files cannot be had keeps the identity of its id and revision
    unknown = model_handle(ModelConfig(source="acme/unknown"))
    assert unknown.tokenizer_fingerprint == unknown.fingerprint != hub.tokenizer_fingerprint
