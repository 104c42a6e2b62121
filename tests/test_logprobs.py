import torch

from trainers.collators import PreferenceCollator, prompt_completion_batch
from trainers.logprobs import completion_logps, token_logps


def test_token_logps_equals_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    naive = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logps(logits, targets), naive, atol=1e-6)


def test_completion_logps_counts_only_completion_tokens(tiny):
    model, tokenizer = tiny
    pad = tokenizer.pad_token_id
    prompts = [[10, 11, 12], [13]]
    completions = [[20, 21], [22, 23, 24, 25, 2]]
    batch = prompt_completion_batch(prompts, completions, pad)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21, pad], [13, 22, 23, 24, 25, 2]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1]]

    got = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            sequence = torch.tensor([prompt + completion])  # unpadded, alone: nothing else can leak in
            logprobs = torch.log_softmax(model(sequence).logits[0], -1)
            expected = sum(logprobs[len(prompt) - 1 + i, token] for i, token in enumerate(completion))
            assert abs(got[row].item() - expected.item()) <= 1e-5


def test_preference_collator_stacks_chosen_then_rejected(tiny):
    _, tokenizer = tiny
    pad = tokenizer.pad_token_id
    features = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 2], "rejected_ids": [8, 9, 2], "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0},
        {"prompt_ids": [5], "chosen_ids": [7, 7, 2], "rejected_ids": [2], "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0},
    ]
    batch = PreferenceCollator(pad)(features)
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 2, pad],
        [5, 7, 7, 2, pad],
        [5, 6, 8, 9, 2],
        [5, 2, pad, pad, pad],
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch["ref_chosen_logps"].tolist() == [-1.0, -3.0]
    assert batch["ref_rejected_logps"].tolist() == [-2.0, -4.0]
