"""Data formats (standard / conversational, explicit / implicit prompt, messages, CSV, Parquet,
Arrow, column mapping, mixing), completions rendered by the chat template, truncation counts and
errors that name the file, row and field. Each format test checks the exact ids of one row."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers import STYLES, chat_tokenizer
from prefect.logging import disable_run_logger

from infra.core.config import DataConfig, DatasetSource, ModelConfig
from tasks.data import data_fingerprint, prepare_dataset, prepare_split
from tasks.models import resolve_model
from trainers.data.collators import IGNORE_INDEX, CompletionOnlyCollator, PreferenceCollator
from trainers.data.rows import (
    SPLIT_FIELDS,
    DataValidationError,
    Truncation,
    load_rows,
    normalize_rows,
    render_rows,
    tokenize_rows,
    validate_rows,
)
from trainers.models.pretrained import load_tokenizer
from trainers.reward.trainer import PairSequenceCollator

pytestmark = pytest.mark.unit

LONG = Truncation(max_length=256, max_prompt_length=128)


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer("chatml")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(rows, split, tokenizer, source="inline", truncation=LONG):
    rows = normalize_rows(rows, split, source)
    validate_rows(rows, SPLIT_FIELDS[split], source)
    return tokenize_rows(rows, split, tokenizer, truncation, source)


def system(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


PROMPT = [system("Be brief."), user("Sky?")]


def chatml_ids(tokenizer, *pieces):
    """Ids of ``pieces``: a special token as itself, any other string as its characters."""
    tokens = []
    for piece in pieces:
        tokens += [piece] if piece in tokenizer.get_added_vocab() else list(piece)
    return tokenizer.convert_tokens_to_ids(tokens)


def chatml_prompt(tokenizer):
    return chatml_ids(
        tokenizer,
        "<|im_start|>", "system\nBe brief.", "<|im_end|>", "\n",
        "<|im_start|>", "user\nSky?", "<|im_end|>", "\n",
        "<|im_start|>", "assistant\n",
    )  # fmt: skip


def test_conversational_preference_explicit_prompt_exact_ids_and_masks(chatml):
    rows = [{"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("green.")]}]
    result = prepare(rows, "preference", chatml)
    prompt = chatml_prompt(chatml)
    chosen = chatml_ids(chatml, "blue.", "<|im_end|>")  # the template's end of turn, not EOS and no "\n"
    rejected = chatml_ids(chatml, "green.", "<|im_end|>")
    assert result.rows == [{"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}]
    batch = PreferenceCollator(chatml.pad_token_id)(result.rows)
    pad = chatml.pad_token_id
    assert batch["input_ids"].tolist() == [prompt + chosen + [pad], prompt + rejected]
    assert batch["completion_mask"].tolist() == [
        [0] * len(prompt) + [1] * len(chosen) + [0],
        [0] * len(prompt) + [1] * len(rejected),
    ]


def test_implicit_prompt_is_the_longest_common_message_prefix(chatml):
    rows = [{"chosen": [*PROMPT, assistant("blue.")], "rejected": [*PROMPT, assistant("green.")]}]
    assert normalize_rows(rows, "preference", "x") == [
        {"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("green.")]}
    ]
    (row,) = prepare(rows, "preference", chatml).rows
    assert row == {
        "prompt_ids": chatml_prompt(chatml),
        "chosen_ids": chatml_ids(chatml, "blue.", "<|im_end|>"),
        "rejected_ids": chatml_ids(chatml, "green.", "<|im_end|>"),
    }


def test_standard_implicit_prompt_is_the_shared_text_before_the_completions_space(chatml):
    """TRL's standard implicit-prompt pairs: strings with a shared prefix; the space before the first
    differing character starts the completions."""
    rows = [{"chosen": "The sky is blue.", "rejected": "The sky is green."}]
    assert normalize_rows(rows, "preference", "x") == [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    ]
    (row,) = prepare(rows, "preference", chatml).rows
    eos = chatml.eos_token_id
    assert row == {
        "prompt_ids": chatml_ids(chatml, "The sky is"),
        "chosen_ids": [*chatml_ids(chatml, " blue."), eos],
        "rejected_ids": [*chatml_ids(chatml, " green."), eos],
    }
    assert normalize_rows([{"chosen": "2+2=4", "rejected": "2+2=5"}], "preference", "x")[0]["prompt"] == "2+2="
    with pytest.raises(DataValidationError, match=r"^pairs\.jsonl: row 0: .*share no leading text \(implicit prompt\)"):
        normalize_rows([{"chosen": "Blue.", "rejected": "Green."}], "preference", "pairs.jsonl")


@pytest.mark.parametrize("shape", ["messages", "prompt_completion"])
def test_conversational_sft_exact_ids_and_labels(chatml, shape):
    if shape == "messages":
        rows = [{"messages": [*PROMPT, assistant("blue.")]}]
    else:
        rows = [{"prompt": PROMPT, "completion": [assistant("blue.")]}]
    (row,) = prepare(rows, "sft", chatml).rows
    prompt, completion = chatml_prompt(chatml), chatml_ids(chatml, "blue.", "<|im_end|>")
    assert row == {"prompt_ids": prompt, "completion_ids": completion}
    batch = CompletionOnlyCollator(chatml.pad_token_id)([row])
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * len(prompt) + completion]


def test_messages_split_before_the_last_assistant_turn(chatml):
    rows = [{"messages": [user("Hi"), assistant("Yo"), user("Sky?"), assistant("blue.")]}]
    (row,) = prepare(rows, "sft", chatml).rows
    assert row["prompt_ids"] == chatml_ids(
        chatml,
        "<|im_start|>", "user\nHi", "<|im_end|>", "\n", "<|im_start|>", "assistant\nYo", "<|im_end|>", "\n",
        "<|im_start|>", "user\nSky?", "<|im_end|>", "\n", "<|im_start|>", "assistant\n",
    )  # fmt: skip
    assert row["completion_ids"] == chatml_ids(chatml, "blue.", "<|im_end|>")


def test_roles_inside_a_completion_are_rendered(chatml):
    rows = [{"prompt": [user("Sky?")], "completion": [assistant("Look."), user("Ok"), assistant("blue.")]}]
    (row,) = prepare(rows, "sft", chatml).rows
    assert row["completion_ids"] == chatml_ids(
        chatml, "Look.", "<|im_end|>", "\n", "<|im_start|>", "user\nOk", "<|im_end|>", "\n",
        "<|im_start|>", "assistant\nblue.", "<|im_end|>",
    )  # fmt: skip


@pytest.mark.parametrize("style", sorted(STYLES))
def test_end_of_turn_token_is_the_last_trained_token_of_every_completion(style):
    tokenizer = chat_tokenizer(style)
    end_of_turn = tokenizer.convert_tokens_to_ids(STYLES[style][4])
    pairs = prepare(
        [{"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("It is green. ")]}],
        "preference",
        tokenizer,
    ).rows
    sft = prepare([{"messages": [*PROMPT, assistant("blue.")]}], "sft", tokenizer).rows
    batch = PreferenceCollator(tokenizer.pad_token_id)(pairs)
    for ids, mask in zip(batch["input_ids"].tolist(), batch["completion_mask"].tolist()):
        trained = [token for token, m in zip(ids, mask) if m]
        assert trained[-1] == end_of_turn and tokenizer.eos_token_id not in trained
        assert 1 not in mask[: len(pairs[0]["prompt_ids"])]  # nothing of the prompt
    labels = CompletionOnlyCollator(tokenizer.pad_token_id)(sft)["labels"][0].tolist()
    trained = [token for token in labels if token != IGNORE_INDEX]
    assert trained[-1] == end_of_turn and tokenizer.decode(trained) == "blue." + STYLES[style][4]


def test_completions_that_end_without_a_stop_token_are_counted():
    """A template whose turn marker is plain text (not a special token) trains ``'…<end_of_turn>\n'``
    with ``'\n'`` last: generation could never stop there. String completions end with EOS."""
    tokenizer = chat_tokenizer("chatml")
    rows = [
        {"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("green.")]},
        {"prompt": "Sky?", "chosen": "blue.", "rejected": "green."},
    ]
    assert prepare(rows, "preference", tokenizer).unterminated == 0  # <|im_end|>, then EOS
    tokenizer.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    result = prepare(rows, "preference", tokenizer)
    assert result.unterminated == 1 and tokenizer.decode(result.rows[0]["chosen_ids"]) == "blue.<end_of_turn>\n"


def test_a_template_that_is_not_prefix_stable_is_an_error_naming_the_row():
    tokenizer = chat_tokenizer("chatml")
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": [user("1+2=")], "completion": [assistant("3")]}]
    with pytest.raises(DataValidationError, match=r"^sft\.jsonl: row 1: TemplateError: .*not prefix-stable"):
        prepare(rows, "sft", tokenizer, source="sft.jsonl")


def test_csv_columns_are_strings_exact_ids(tiny, tmp_path):
    _, tokenizer = tiny
    path = tmp_path / "sft.csv"
    path.write_text("prompt,completion\n007+1=,008\n")
    rows = load_rows(str(path))
    assert rows == [{"prompt": "007+1=", "completion": "008"}]
    path.write_bytes(b"\xef\xbb\xbfprompt,completion\r\n007+1=,008\r\n")  # as spreadsheets save it
    assert load_rows(str(path)) == rows
    (row,) = prepare(rows, "sft", tokenizer, str(path), Truncation(32, 16)).rows
    ids = tokenizer.convert_tokens_to_ids
    assert row == {"prompt_ids": ids(list("007+1=")), "completion_ids": ids(list("008")) + [tokenizer.eos_token_id]}


def test_parquet_with_column_mapping_exact_ids(tiny, tmp_path):
    _, tokenizer = tiny
    path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list([{"question": "1+2=", "answer_good": "3", "answer_bad": "4", "id": 7}]).to_parquet(path)
    rows = load_rows(str(path), columns={"prompt": "question", "chosen": "answer_good", "rejected": "answer_bad"})
    assert rows == [{"id": 7, "prompt": "1+2=", "chosen": "3", "rejected": "4"}]
    (row,) = prepare(rows, "preference", tokenizer, str(path), Truncation(32, 16)).rows
    ids, eos = tokenizer.convert_tokens_to_ids, tokenizer.eos_token_id
    assert row == {
        "prompt_ids": ids(list("1+2=")),
        "chosen_ids": ids(["3"]) + [eos],
        "rejected_ids": ids(["4"]) + [eos],
    }


def test_arrow_file_and_saved_dataset_folder(tiny, tmp_path):
    rows = [{"prompt": [user("Sky?")], "completion": [assistant("blue.")]}]
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "saved_dict"))
    (arrow_file,) = (tmp_path / "saved").glob("*.arrow")
    assert load_rows(str(tmp_path / "saved")) == rows
    assert load_rows(str(tmp_path / "saved_dict"), split="train") == rows
    assert load_rows(str(arrow_file)) == rows
    with pytest.raises(DataValidationError, match="no split 'test'"):
        load_rows(str(tmp_path / "saved_dict"), split="test")


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".arrow"])
def test_reading_a_local_file_leaves_no_copy_in_the_datasets_cache(tmp_path, monkeypatch, suffix):
    """datasets' builders convert a local file to an Arrow copy in ``~/.cache/huggingface/datasets``
    (one per file version, never read again: the prepared dataset is written elsewhere)."""
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)  # where load_dataset writes by default
    rows = [{"prompt": "1+1=", "completion": "2"}]
    path = tmp_path / f"sft{suffix}"
    if suffix == ".csv":
        path.write_text("prompt,completion\n1+1=,2\n")
    elif suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
        (arrow_file,) = (tmp_path / "saved").glob("*.arrow")
        arrow_file.rename(path)
    assert load_rows(str(path)) == rows
    assert not cache.exists() or list(cache.rglob("*")) == []


def test_mixing_is_seeded_and_counts_rows_per_source(tiny, tmp_path):
    _, tokenizer = tiny
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"{i}+0=", "completion": str(i)} for i in range(6)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "9+9=", "completion": "18"}])
    sources = [DatasetSource(path=str(a), num_samples=3), DatasetSource(path=str(b), weight=2.0)]
    parts = [(s.path, render_rows(load_rows(s.path), "sft", tokenizer, s.path), s) for s in sources]
    rows, report = prepare_split(parts, "sft", Truncation(32, 16), seed=0)
    assert prepare_split(parts, "sft", Truncation(32, 16), seed=0) == (rows, report)
    ids, eos = tokenizer.convert_tokens_to_ids, tokenizer.eos_token_id
    assert rows[3:] == [{"prompt_ids": ids(list("9+9=")), "completion_ids": ids(list("18")) + [eos]}] * 2
    firsts = [tokenizer.decode(r["prompt_ids"]) for r in rows[:3]]
    assert len(set(firsts)) == 3 and all(p.endswith("+0=") for p in firsts)
    others = {
        tuple(tokenizer.decode(r["prompt_ids"]) for r in prepare_split(parts, "sft", Truncation(32, 16), seed=s)[0][:3])
        for s in range(5)
    }
    assert len(others) > 1  # the seed chooses the rows
    assert report["sources"] == [
        {"source": str(a), "rows_read": 6, "dropped": 0, "truncated_prompts": 0, "rows_used": 3},
        {"source": str(b), "rows_read": 1, "dropped": 0, "truncated_prompts": 0, "rows_used": 2},
    ]


def test_truncated_prompts_are_counted_and_drop_mode_drops(tiny):
    _, tokenizer = tiny
    rows = [{"prompt": "123456789", "completion": "ab"}, {"prompt": "12", "completion": "ab"}]
    cut = tokenize_rows(rows, "sft", tokenizer, Truncation(32, 4))
    assert (len(cut.rows), cut.dropped, cut.truncated_prompts) == (2, 0, 1)
    dropped = tokenize_rows(rows, "sft", tokenizer, Truncation(32, 4, mode="drop"))
    assert (dropped.dropped, dropped.truncated_prompts) == (1, 0)
    assert tokenizer.decode(dropped.rows[0]["prompt_ids"]) == "12"
    # a completion that does not fit is dropped too, not cut: 2 prompt + 3 completion tokens > 4
    assert tokenize_rows(rows[1:], "sft", tokenizer, Truncation(4, 4, mode="drop")).dropped == 1


def test_pairs_whose_chosen_and_rejected_render_alike_are_left_out_and_counted(chatml):
    rows = [
        {"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("blue.")]},
        {"prompt": "Sky?", "chosen": "blue", "rejected": "blue"},
        {"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("green.")]},
    ]
    result = prepare(rows, "preference", chatml)
    assert (len(result.rows), result.identical, result.dropped) == (1, 2, 0)
    assert chatml.decode(result.rows[0]["rejected_ids"]) == "green.<|im_end|>"


def test_the_system_head_cut_by_keep_end_is_counted(chatml):
    rows = [{"prompt": PROMPT, "chosen": [assistant("blue.")], "rejected": [assistant("green.")]}]
    result = prepare(rows, "preference", chatml, truncation=Truncation(64, 12))
    assert result.truncated_prompts == 1
    assert chatml.decode(result.rows[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "row, split, message",
    [
        ({"messages": [user("a"), user("b")]}, "sft", "row 1: field 'messages' has no assistant message"),
        ({"messages": "hi"}, "sft", "row 1: field 'messages' must be a list of {role, content} messages"),
        ({"messages": [user("a"), assistant("")]}, "sft", "row 1: field 'completion' is an empty completion"),
        (
            {"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]},
            "preference",
            "row 1: field 'prompt' is missing and 'chosen' and 'rejected' share no leading message",
        ),
        ({"chosen": "b", "rejected": "c"}, "preference", "row 1: field 'prompt' is missing"),
        (
            {"prompt": "1+1=", "chosen": [assistant("2")], "rejected": "3"},
            "preference",
            "row 1: field 'chosen' is conversational but 'prompt' is a string",
        ),
    ],
)
def test_malformed_rows_of_every_format_name_file_row_and_field(tmp_path, row, split, message):
    good = (
        {"messages": [user("a"), assistant("b")]} if split == "sft" else {"prompt": "a", "chosen": "b", "rejected": "c"}
    )
    path = write_jsonl(tmp_path / "data.jsonl", [good, row])
    with pytest.raises(DataValidationError) as error:
        validate_rows(normalize_rows(load_rows(str(path)), split, str(path)), SPLIT_FIELDS[split], str(path))
    assert str(error.value).startswith(f"{path}: {message}")


def test_csv_and_mapped_columns_that_are_missing_are_reported_missing(tmp_path):
    path = tmp_path / "sft.csv"
    path.write_text("prompt\n1+1=\n")
    with pytest.raises(DataValidationError, match=r"sft\.csv: row 0: field 'completion' is missing$"):
        validate_rows(load_rows(str(path)), SPLIT_FIELDS["sft"], str(path))
    path.write_text("prompt,completion\n1+1=,\n")
    with pytest.raises(DataValidationError, match=r"sft\.csv: row 0: field 'completion' is an empty completion"):
        validate_rows(load_rows(str(path)), SPLIT_FIELDS["sft"], str(path))
    path.write_text("question,completion\n1+1=,2\n")
    with pytest.raises(DataValidationError, match=r"sft\.csv: row 0: field 'prompt' \(column 'q'\) is missing"):
        load_rows(str(path), columns={"prompt": "q"})


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", b'{"prompt": "a"}\n{"prompt": "\xff"}\n', r"bad\.jsonl: line 2: not UTF-8 text"),
        ("bad.json", b'[{"prompt": "\xe9"}]', r"bad\.json: line 1: not UTF-8 text"),
        ("bad.csv", b"prompt,completion\n1,2\n3,\xff\n", r"bad\.csv: line 3: not UTF-8 text \(byte 24"),
        ("broken.json", b'[{"prompt": "a"},\n {"prompt": ', r"broken\.json: line 2 column 13: invalid JSON"),
        ("empty.jsonl", b"", r"empty\.jsonl: the dataset has no rows"),
        ("empty.json", b"[]", r"empty\.json: the dataset has no rows"),
        ("empty.csv", b"", r"empty\.csv: the dataset has no rows"),
        ("header.csv", b"prompt,completion\n", r"header\.csv: the dataset has no rows"),
    ],
)
def test_unreadable_and_empty_files_are_named(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataValidationError, match=message):
        load_rows(str(path))


@pytest.fixture(scope="module")
def base():
    return resolve_model.fn(ModelConfig())


def test_chat_template_override_and_source_options_change_the_prepared_data(base, tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNFLOW_TEMPLATE_DIRS", str(tmp_path))
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": [user("1+2=")], "chosen": [assistant("3")], "rejected": [assistant("4")]}]
    )
    template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
    (tmp_path / "template.jinja").write_text(template)
    config = DataConfig(builtin=None, preference=DatasetSource(path=str(pairs)))
    with_string = config.model_copy(update={"chat_template": template})
    with_file = config.model_copy(update={"chat_template": str(tmp_path / "template.jinja")})
    keys = {data_fingerprint(c, base) for c in (config, with_string)}
    assert len(keys) == 2 and data_fingerprint(with_file, base) == data_fingerprint(with_string, base)
    for update in ({"weight": 2.0}, {"num_samples": 3}, {"columns": {"prompt": "prompt"}}):
        mixed = config.model_copy(update={"preference": [DatasetSource(path=str(pairs), **update)]})
        assert data_fingerprint(mixed, base) not in keys
    with disable_run_logger():
        prepared = prepare_dataset.fn(with_file, base)
    (row,) = datasets.load_from_disk(prepared.path)["preference"]
    tokenizer = load_tokenizer(base.path)
    ids, eos = tokenizer.convert_tokens_to_ids, tokenizer.eos_token_id
    assert row == {
        "prompt_ids": ids(list("1+2=")),
        "chosen_ids": ids(["3"]) + [eos],
        "rejected_ids": ids(["4"]) + [eos],
    }
    assert prepared.truncated_prompts == {"preference": 0} and prepared.dropped == {"preference": 0}
    manifest = json.loads((Path(prepared.path).parent / "manifest.json").read_text())
    assert manifest["sources"] == {
        "preference": [{"source": str(pairs), "rows_read": 1, "dropped": 0, "truncated_prompts": 0, "rows_used": 1}]
    }


def test_data_config_takes_one_source_or_a_list_with_mixing_options(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from infra.core.config import ExperimentConfig, did_you_mean, load_config

    monkeypatch.chdir(tmp_path)  # the config checks that local data files exist
    (tmp_path / "a.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    (tmp_path / "b.csv").write_text("question,completion\n1+1=,2\n")

    single = load_config(None, ["data.builtin=null", "stages=[sft]", "data.sft={path: a.jsonl}"])
    assert single.data.sft == DatasetSource(path="a.jsonl")
    mixed = load_config(
        None,
        [
            "data.builtin=null",
            "stages=[sft]",
            "data.sft=[{path: a.jsonl, weight: 0.5}, {path: b.csv, num_samples: 10, columns: {prompt: question}}]",
            "data.truncation_mode=drop",
        ],
    )
    assert [s.path for s in mixed.data.sft] == ["a.jsonl", "b.csv"] and mixed.data.sft[1].columns == {
        "prompt": "question"
    }
    with pytest.raises(ValidationError, match="give weight or num_samples, not both"):
        DatasetSource(path="a.jsonl", weight=1.0, num_samples=3)
    with pytest.raises(ValidationError, match="an empty list of sources"):
        DataConfig(sft=[])
    with pytest.raises(ValidationError, match="greater than 0"):
        DatasetSource(path="a.jsonl", weight=0)
    with pytest.raises(ValidationError) as error:
        load_config(None, ["data.sft=[{path: a.jsonl}, {path: b.jsonl, wieght: 2}]"])
    assert did_you_mean(error.value, ExperimentConfig) == [
        "unknown key data.sft.1.wieght: did you mean data.sft.1.weight?"
    ]


def test_a_mix_that_selects_no_rows_is_an_error(tiny, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 3)
    parts = [(str(path), render_rows(load_rows(str(path)), "sft", tiny[1]), DatasetSource(path=str(path), weight=0.1))]
    with pytest.raises(ValueError, match="select no rows"):
        prepare_split(parts, "sft", Truncation(32, 16), seed=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".arrow", "/"])
def test_a_malformed_row_names_file_row_and_field_in_every_file_format(tmp_path, suffix):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": " "}]
    dataset = datasets.Dataset.from_list(rows)
    path = tmp_path / f"sft{suffix}".rstrip("/")
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        dataset.to_csv(path, index=False)
    elif suffix == ".parquet":
        dataset.to_parquet(path)
    else:
        dataset.save_to_disk(str(path))
        if suffix == ".arrow":
            (path,) = path.glob("*.arrow")
    with pytest.raises(DataValidationError) as error:
        validate_rows(load_rows(str(path)), SPLIT_FIELDS["sft"], str(path))
    assert str(error.value) == f"{path}: row 1: field 'completion' is an empty completion"


def test_a_margin_column_of_the_pairs_is_kept_as_a_number_and_checked(tiny, tmp_path):
    """Llama 2's margin for the reward model's loss: read from JSON numbers and CSV text alike, kept
    in the prepared pairs; a value that is not a finite number names the file, row and field; a
    split where only some pairs have one is an error."""
    _, tokenizer = tiny
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.5}]
    rows += [{"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": "0.25"}]  # as a CSV file reads it
    source = str(tmp_path / "pairs.jsonl")
    parts = [(source, render_rows(rows, "preference", tokenizer, source), None)]
    prepared, _ = prepare_split(parts, "preference", Truncation(32, 16), seed=0)
    assert [row["margin"] for row in prepared] == [1.5, 0.25]
    assert PairSequenceCollator(tokenizer.pad_token_id)(prepared)["margin"].tolist() == [1.5, 0.25]
    for bad in ("high", float("nan"), True):
        with pytest.raises(DataValidationError, match=rf"{source}: row 1: field 'margin' must be a finite number"):
            render_rows([rows[0], {**rows[1], "margin": bad}], "preference", tokenizer, source)
    partial = [
        (
            source,
            render_rows(
                [rows[0], {k: v for k, v in rows[1].items() if k != "margin"}], "preference", tokenizer, source
            ),
            None,
        )
    ]
    with pytest.raises(DataValidationError, match="1 of 2 pairs have a 'margin': give every pair one, or none"):
        prepare_split(partial, "preference", Truncation(32, 16), seed=0)


def test_unpaired_rows_keep_their_label_and_a_bad_label_names_the_row(tiny, tmp_path):
    """TRL's unpaired format (KTO): prompt, completion and a boolean label (CSV text too)."""
    _, tokenizer = tiny
    rows = [
        {"prompt": "1+1=", "completion": "2", "label": True},
        {"prompt": "1+1=", "completion": "3", "label": "false"},  # as a CSV file reads it
    ]
    source = str(tmp_path / "feedback.jsonl")
    validate_rows(rows, SPLIT_FIELDS["unpaired"], source)
    prepared, _ = prepare_split(
        [(source, render_rows(rows, "unpaired", tokenizer, source), None)], "unpaired", Truncation(32, 16), 0
    )
    ids, eos = tokenizer.convert_tokens_to_ids, tokenizer.eos_token_id
    assert prepared == [
        {"prompt_ids": ids(list("1+1=")), "completion_ids": ids(["2"]) + [eos], "label": True},
        {"prompt_ids": ids(list("1+1=")), "completion_ids": ids(["3"]) + [eos], "label": False},
    ]
    for bad, message in (
        (1, "must be true or false, got 1"),
        ("yes", "must be true or false, got 'yes'"),
        (None, "is missing"),
    ):
        with pytest.raises(DataValidationError, match=rf"{source}: row 1: field 'label' {message}"):
            render_rows([rows[0], {**rows[1], "label": bad}], "unpaired", tokenizer, source)
