"""GRPO's data order: RepeatSampler, the batch arithmetic, and sharding over 2 processes."""

import pytest
from accelerate.data_loader import prepare_data_loader

from trainers.grpo.layout import GenerationLayout, resolve_layout
from trainers.grpo.samplers import RepeatSampler, generation_dataloader

pytestmark = pytest.mark.unit


def test_unshuffled_order_repeats_and_drops_the_incomplete_chunk():
    sampler = RepeatSampler(5, num_generations=2, prompts_per_chunk=2, repeats=2, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]  # prompt 4 is dropped
    assert len(sampler) == 16


def test_shuffled_order_is_fixed_by_seed_and_epoch():
    sampler = RepeatSampler(6, num_generations=3, prompts_per_chunk=3, repeats=1, shuffle=True, seed=3)
    # torch.randperm(6, generator seeded with 3 + epoch 0) = [4, 0, 3, 2, 1, 5]
    assert list(sampler) == [4, 4, 4, 0, 0, 0, 3, 3, 3, 2, 2, 2, 1, 1, 1, 5, 5, 5]
    assert list(sampler) == list(RepeatSampler(6, num_generations=3, prompts_per_chunk=3, shuffle=True, seed=3))
    sampler.set_epoch(1)  # seed 3 + epoch 1 = [4, 5, 1, 2, 3, 0]
    assert list(sampler) == [4, 4, 4, 5, 5, 5, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0, 0, 0]
    assert len(sampler) == 18


def test_len_equals_iteration_length_when_chunks_are_dropped():
    for rows, chunk, repeats in [(7, 3, 2), (9, 3, 1), (10, 4, 3)]:
        sampler = RepeatSampler(rows, num_generations=2, prompts_per_chunk=chunk, repeats=repeats, shuffle=True, seed=1)
        indices = list(sampler)
        assert len(sampler) == len(indices) == (rows // chunk) * chunk * 2 * repeats
        assert len(set(indices)) == (rows // chunk) * chunk


def test_too_few_prompts_for_one_generation_batch_is_an_error():
    with pytest.raises(ValueError, match="3 prompts cannot fill one generation batch of 4 prompts"):
        RepeatSampler(3, num_generations=2, prompts_per_chunk=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_generations=1), "num_generations must be at least 2"),
        (dict(steps_per_generation=2, generation_batch_size=16), "not both"),
        (
            dict(generation_batch_size=12),
            r"generation_batch_size \(12\) must be divisible by per_device_train_batch_size × processes \(8 × 1 = 8\)",
        ),
        (
            dict(num_generations=3),
            r"per_device_train_batch_size × steps_per_generation \(8 "
            r"× 2 = 16\) must be divisible by num_generations \(3\)",
        ),
    ],
)
def test_layout_errors_name_the_fields(kwargs, message):
    settings = dict(per_device_batch_size=8, gradient_accumulation_steps=2, num_generations=4) | kwargs
    with pytest.raises(ValueError, match=message):
        resolve_layout(**settings)


def test_layout_defaults_to_accumulation_steps_or_derives_from_generation_batch_size():
    assert (
        resolve_layout(per_device_batch_size=8, gradient_accumulation_steps=3, num_generations=4).steps_per_generation
        == 3
    )
    layout = resolve_layout(
        per_device_batch_size=4,
        gradient_accumulation_steps=1,
        num_generations=4,
        num_processes=2,
        generation_batch_size=32,
    )
    assert (layout.steps_per_generation, layout.per_device_generation_batch_size, layout.prompts_per_generation) == (
        4,
        16,
        8,
    )


def test_two_process_shards_are_disjoint_and_complete():
    """Accelerate's sharding of the real dataloader: each process gets whole groups of its own
    prompts, the same part on every repeat, and the two parts make the whole generation batch."""
    layout = GenerationLayout(
        per_device_batch_size=2, num_processes=2, steps_per_generation=2, num_generations=2
    )  # 8 rows per generation
    dataset, iterations = list(range(11)), 2

    def shard(process):
        loader = generation_dataloader(dataset, layout, num_iterations=iterations, seed=5, collate_fn=list)
        return list(prepare_data_loader(loader, num_processes=2, process_index=process, put_on_device=False))

    reference = list(RepeatSampler(11, num_generations=2, prompts_per_chunk=4, repeats=4, seed=5))
    cycle = layout.steps_per_generation * iterations  # batches per generation batch and process
    shards = [shard(0), shard(1)]
    assert [len(s) for s in shards] == [2 * cycle, 2 * cycle]  # 11 prompts -> 2 generation batches of 4; 3 dropped
    for generation in range(2):
        parts = [s[generation * cycle : (generation + 1) * cycle] for s in shards]
        for part in parts:
            assert all(batch == part[0] for batch in part) and len(part[0]) == 4  # the same rows every step
            assert part[0][0::2] == part[0][1::2]  # whole groups: each prompt twice in a row
        mine, theirs = set(parts[0][0]), set(parts[1][0])
        assert not mine & theirs
        whole = reference[generation * 8 * cycle : generation * 8 * cycle + 8]
        assert sorted(parts[0][0] + parts[1][0]) == sorted(whole)


def test_each_configurable_generation_backend_has_its_class():
    from typing import get_args

    from trainers.grpo.rollouts import ENGINE_MODES, GENERATION_BACKENDS, EngineBackend, PolicyBackend
    from trainers.grpo.section import GenerationBackendName, VllmMode

    assert set(get_args(GenerationBackendName)) == set(GENERATION_BACKENDS)
    assert GENERATION_BACKENDS == {"hf": PolicyBackend, "vllm": EngineBackend}
    assert set(get_args(VllmMode)) == set(ENGINE_MODES)
