import json

import pytest
import torch

from trainers.data.collators import IGNORE_INDEX, CompletionOnlyCollator, PreferenceCollator
from trainers.data.rows import DataValidationError, Truncation, load_rows, tokenize_split, validate_rows
from trainers.data.synthetic import AdditionTask, generate_addition

pytestmark = pytest.mark.unit


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"prompt": "1+1=", "rejected": "3"}, "row 1: field 'chosen' is missing"),
        ({"prompt": "1+1=", "chosen": "  ", "rejected": "3"}, "row 1: field 'chosen' is an empty completion"),
        (
            {"prompt": "1+1=", "chosen": "2", "rejected": 3},
            "row 1: field 'rejected' must be a string or a list of {role, content} messages, got int",
        ),
    ],
)
def test_validation_names_file_row_and_field(tmp_path, bad_row, message):
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, bad_row])
    with pytest.raises(DataValidationError) as error:
        validate_rows(load_rows(str(path)), ("prompt", "chosen", "rejected"), str(path))
    assert str(error.value) == f"{path}: {message}"


def test_conversational_rows_render_with_chat_template(tiny):
    _, tokenizer = tiny
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+2="}],
            "chosen": [{"role": "assistant", "content": "3"}],
            "rejected": "4",
        }
    ]
    validate_rows(rows, ("prompt", "chosen", "rejected"), "inline")
    (row,), dropped = tokenize_split(rows, "preference", tokenizer, Truncation(32, 16))
    assert dropped == 0
    assert tokenizer.decode(row["prompt_ids"]) == "<|user|>1+2=<|assistant|>"
    assert row["chosen_ids"] == tokenizer("3", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def test_truncation_keep_end_and_dropped_pairs(tiny):
    _, tokenizer = tiny
    rows = [{"prompt": "123456789", "chosen": "ab", "rejected": "c"}]
    (kept,), dropped = tokenize_split(
        rows, "preference", tokenizer, Truncation(max_length=6, max_prompt_length=4, mode="keep_end")
    )
    assert tokenizer.decode(kept["prompt_ids"]) == "6789"
    assert tokenizer.decode(kept["chosen_ids"]) == "ab"  # 4 prompt + 2 completion tokens: the EOS is cut
    (kept,), _ = tokenize_split(
        rows, "preference", tokenizer, Truncation(max_length=6, max_prompt_length=4, mode="keep_start")
    )
    assert tokenizer.decode(kept["prompt_ids"]) == "1234"
    kept, dropped = tokenize_split(rows, "preference", tokenizer, Truncation(max_length=4, max_prompt_length=4))
    assert kept == [] and dropped == 1


def test_only_pairs_whose_completion_is_cut_to_nothing_are_dropped_and_counted(tiny):
    _, tokenizer = tiny
    rows = [
        {"prompt": "1234567", "chosen": "ab", "rejected": "c"},  # 6-token prompt fills max_length: dropped
        {"prompt": "12345", "chosen": "ab", "rejected": "c"},  # 5 prompt tokens leave 1 for each completion
        {"prompt": "123456", "chosen": "ab", "rejected": "c"},  # dropped
        {"prompt": [{"role": "user", "content": "9876543"}], "chosen": "ab", "rejected": "c"},  # dropped
    ]
    kept, dropped = tokenize_split(
        rows, "preference", tokenizer, Truncation(max_length=6, max_prompt_length=6, mode="keep_end")
    )
    assert dropped == 3
    (row,) = kept
    assert tokenizer.decode(row["prompt_ids"]) == "12345"
    assert row["chosen_ids"] == tokenizer.convert_tokens_to_ids(["a"]) and row[
        "rejected_ids"
    ] == tokenizer.convert_tokens_to_ids(["c"])
    # keep_end on a conversational prompt keeps the generation prompt that the completion follows
    (row,), _ = tokenize_split(
        rows[3:], "preference", tokenizer, Truncation(max_length=8, max_prompt_length=5, mode="keep_end")
    )
    assert tokenizer.decode(row["prompt_ids"]) == "6543<|assistant|>"
    assert tokenizer.decode(row["chosen_ids"]) == "ab</s>"


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_collated_pair_batch_has_exact_ids_and_masks(tiny, conversational):
    _, tokenizer = tiny
    ids = tokenizer.convert_tokens_to_ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if conversational:
        user, assistant = (
            lambda text: [{"role": "user", "content": text}],
            lambda text: [{"role": "assistant", "content": text}],
        )
        rows = [
            {"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("12")},
            {"prompt": user("10+5="), "chosen": assistant("15"), "rejected": assistant("5")},
        ]
        prompts = [
            ids(["<|user|>", "1", "+", "2", "=", "<|assistant|>"]),
            ids(["<|user|>", "1", "0", "+", "5", "=", "<|assistant|>"]),
        ]
    else:
        rows = [
            {"prompt": "1+2=", "chosen": "3", "rejected": "12"},
            {"prompt": "10+5=", "chosen": "15", "rejected": "5"},
        ]
        prompts = [ids(list("1+2=")), ids(list("10+5="))]
    validate_rows(rows, ("prompt", "chosen", "rejected"), "inline")
    features, dropped = tokenize_split(rows, "preference", tokenizer, Truncation(32, 16))
    assert dropped == 0
    batch = PreferenceCollator(pad)(features)

    chosen = [ids(["3"]) + [eos], ids(["1", "5"]) + [eos]]
    rejected = [ids(["1", "2"]) + [eos], ids(["5"]) + [eos]]
    sequences = [p + c for p, c in zip(prompts + prompts, chosen + rejected)]
    width = max(map(len, sequences))
    assert batch["input_ids"].tolist() == [s + [pad] * (width - len(s)) for s in sequences]
    assert batch["attention_mask"].tolist() == [[1] * len(s) + [0] * (width - len(s)) for s in sequences]
    assert batch["completion_mask"].tolist() == [
        [0] * len(p) + [1] * len(c) + [0] * (width - len(p) - len(c))
        for p, c in zip(prompts + prompts, chosen + rejected)
    ]


def test_sft_labels_are_the_completion_tokens_and_hide_prompt_and_padding(tiny):
    """Completion-only SFT: the labels are -100 on prompt and padding, the token ids (EOS included)
    on the completion; the loss the Trainer computes from them is the completion's mean NLL."""
    model, tokenizer = tiny
    ids = tokenizer.convert_tokens_to_ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "10+5=", "completion": "15"}]
    features, _ = tokenize_split(rows, "sft", tokenizer, Truncation(32, 16))
    batch = CompletionOnlyCollator(pad)(features)
    hidden = IGNORE_INDEX
    assert batch["input_ids"].tolist() == [ids(list("1+2=3")) + [eos, pad, pad], ids(list("10+5=15")) + [eos]]
    assert batch["labels"].tolist() == [
        [hidden] * 4 + ids(["3"]) + [eos, hidden, hidden],
        [hidden] * 5 + ids(["1", "5"]) + [eos],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0] * 2, [1] * 8]

    logps = torch.log_softmax(model(**batch).logits[:, :-1].float(), -1)
    targets = batch["labels"][:, 1:]
    scored = targets != hidden
    nll = -logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[scored].mean()
    assert model(**batch).loss.item() == pytest.approx(nll.item(), abs=1e-5)


def test_builtin_addition_splits_are_disjoint_and_noisy():
    task = AdditionTask(max_operand=19, noise=0.3, num_eval_problems=100, seed=1)
    splits = generate_addition(task)
    assert splits == generate_addition(task)  # deterministic
    eval_prompts = {r["prompt"] for r in splits["eval_prompts"]}
    assert len(eval_prompts) == 100
    assert eval_prompts.isdisjoint(r["prompt"] for r in splits["sft"])
    assert eval_prompts.isdisjoint(r["prompt"] for r in splits["preference"])
    assert {r["prompt"] for r in splits["preference_eval"]} == eval_prompts
    # GRPO trains on the training problems (every one, with its true answer), never on held-out ones
    assert [r["prompt"] for r in splits["grpo_prompts"]] == [r["prompt"] for r in splits["sft"]]
    assert all(int(r["answer"]) == sum(map(int, r["prompt"].rstrip("=").split("+"))) for r in splits["grpo_prompts"])

    def correct(row, field):
        a, b = row["prompt"].rstrip("=").split("+")
        return int(row[field]) == int(a) + int(b)

    wrong = sum(not correct(r, "completion") for r in splits["sft"]) / len(splits["sft"])
    assert 0.25 < wrong < 0.35
    assert all(correct(r, "chosen") and not correct(r, "rejected") for r in splits["preference"])
