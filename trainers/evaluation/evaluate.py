"""Evaluation of a causal LM on verifiable prompts and on held-out preference pairs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Protocol, TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainers.data.collators import PreferenceCollator, pad_left
from trainers.data.lengths import model_context
from trainers.dpo.losses import reward_metrics
from trainers.evaluation.harness import HarnessTask, harness_scores
from trainers.generation.budget import evaluation_generation
from trainers.generation.vllm_engine import EngineOptions, ReusedEngine, SamplingOptions, require_vllm
from trainers.models.attention import packing_for
from trainers.models.pretrained import check_same_vocabulary
from trainers.models.stop_tokens import cut_at_first_stop, stop_token_ids
from trainers.runtime.work_split import batches_of, gather_shards, local_shard
from trainers.scoring.logprobs import completion_logps
from trainers.scoring.metrics import (
    ANSWER_METRICS,
    PREFERENCE_METRICS,
    REWARD_MODEL_METRIC,
    ModelScores,
    bootstrap_ci,
    exact_match,
    pass_at_k,
)
from trainers.scoring.reward_model import RewardModelScorer, load_scorer
from trainers.sections import PaddingFree

if TYPE_CHECKING:
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerateOutput

M = TypeVar("M")

# The evaluation's engine holds one model and nothing trains beside it: most of a GPU's memory.
EVALUATION_ENGINE = EngineOptions(
    gpu_memory_utilization=0.8, max_model_len=None, enable_sleep_mode=False, cpu_kv_cache_gib=1
)


@dataclass(frozen=True)
class GenerationSpec:
    max_new_tokens: int = 8
    num_samples: int = 4
    temperature: float = 1.0
    batch_size: int = 256
    seed: int = 0
    backend: Literal["hf", "vllm"] = "hf"


@dataclass(frozen=True)
class EvaluationSpec:
    """What one model's evaluation computes besides its completions (:func:`evaluate_model`); the
    defaults are ``EvaluationConfig``'s (``EvaluationConfig.spec``)."""

    generation: GenerationSpec
    pass_k: tuple[int, ...]
    bootstrap_resamples: int  # for the 95% CIs, seeded by ``generation.seed``
    num_logged_samples: int  # rows of the samples table
    pair_batch_size: int  # held-out pairs per forward
    padding_free: PaddingFree = "auto"  # of the held-out pairs' forward (``compute.padding_free``)
    suites: tuple[HarnessTask, ...] = ()  # scored by lm-evaluation-harness


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int  # generated tokens up to and including the first stop token
    token_ids: tuple[int, ...] = ()  # those tokens


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    answer: str
    greedy: Completion
    samples: list[Completion]
    prompt_ids: tuple[int, ...] = ()

    @property
    def greedy_correct(self) -> bool:
        return exact_match(self.greedy.text, self.answer)

    @property
    def samples_correct(self) -> list[bool]:
        return [exact_match(s.text, self.answer) for s in self.samples]


class GenerativeModel(Protocol):
    """What :func:`generate_completions` reads of a model: a transformers causal LM (``GenerationMixin``'s)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def generation_config(self) -> GenerationConfig: ...

    def eval(self) -> Any: ...

    def generate(self, *args: Any, **kwargs: Any) -> GenerateOutput | torch.LongTensor: ...


@torch.no_grad()
def generate_completions(
    model: GenerativeModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    *,
    do_sample: bool,
    num_return_sequences: int,
    spec: GenerationSpec,
    state: Any | None = None,
) -> list[list[Completion]]:
    """``num_return_sequences`` completions per prompt, batched, each cut at its first stop token
    (the model's EOS ids and its chat template's end of turn: :mod:`trainers.models.stop_tokens`) and decoded
    without special tokens. Batch ``i`` samples under seed ``spec.seed + i``, so that with ``state``
    (a launch's ``PartialState``) each process generates its share of the batches and every process
    gets all completions, in order, the same as one process."""
    model.eval()
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    sampling = (
        {"do_sample": True, "temperature": spec.temperature, "top_k": 0, "top_p": 1.0}
        if do_sample
        else {"do_sample": False}
    )
    first, mine = local_shard(batches_of(prompts, spec.batch_size), state)
    completions: list[list[Completion]] = []
    # disable=None: a bar on a terminal only; redirected output (logs, CI) gets no bar fragments
    bar = tqdm(mine, desc="sampling" if do_sample else "greedy decoding", mininterval=5, leave=False, disable=None)
    for index, part in enumerate(bar, start=first):
        torch.manual_seed(spec.seed + index)
        input_ids, attention_mask = pad_left(part, tokenizer.pad_token_id)
        output = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=spec.max_new_tokens,
            num_return_sequences=num_return_sequences,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=list(stop_ids),
            **sampling,
        )
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"generate returned {type(output).__name__}, not token ids (return_dict_in_generate is on)")
        completions += decoded(tokenizer, output[:, input_ids.shape[1] :], stop_ids, num_return_sequences)
    return gather_shards(completions, state)


def decoded(
    tokenizer: PreTrainedTokenizerBase, generated: torch.Tensor, stop_ids: tuple[int, ...], per_prompt: int
) -> list[list[Completion]]:
    """Generated rows (``per_prompt`` consecutive rows per prompt) cut at their first stop token and
    decoded without special tokens."""
    return completions(tokenizer, cut_at_first_stop(generated, stop_ids)[0], per_prompt)


def completions(tokenizer: PreTrainedTokenizerBase, kept: list[list[int]], per_prompt: int) -> list[list[Completion]]:
    """Completions already cut at their first stop token (``per_prompt`` consecutive ones per
    prompt), decoded without special tokens."""
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    flat = [Completion(text, len(tokens), tuple(tokens)) for text, tokens in zip(texts, kept)]
    return [flat[i : i + per_prompt] for i in range(0, len(flat), per_prompt)]


def evaluation_engine(seed: int, replaceable: bool = True) -> ReusedEngine:
    """The vLLM engine an evaluation's models share (:func:`score_prompts`' ``engines``); not
    ``replaceable`` in a launch of several processes (:class:`ReusedEngine`)."""
    return ReusedEngine(EVALUATION_ENGINE, seed, replaceable)


def engine_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    spec: GenerationSpec,
    engines: ReusedEngine | None = None,
    state: Any | None = None,
) -> tuple[list[list[Completion]], list[list[Completion]]]:
    """Greedy and ``spec.num_samples`` sampled completions of every prompt by a vLLM engine holding
    ``model``'s weights (``engines``'; without it one built for this model and closed after); sample
    ``j`` of prompt ``i`` under its own seed (``spec.seed``, ``i`` and ``j``), so a prompt's samples
    depend neither on the others, nor on the batching, nor on the models the engine held before, nor
    on the processes of ``state``: each (with an engine of its own) takes its share of the prompts and
    every process gets all completions, in order."""
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    first, mine = local_shard(prompts, state)
    own = engines is None
    if engines is None:
        engines = evaluation_engine(spec.seed)
    engine = engines.serving(model)  # on every process, a share of none included: they build together
    try:
        greedy = engine.generate(
            mine, [spec.seed] * len(mine), SamplingOptions(0.0, 0, 1.0, spec.max_new_tokens, stop_ids)
        )
        n = spec.num_samples
        seeds = [(spec.seed * 1_000_003 + i) * 1024 + j for i in range(first, first + len(mine)) for j in range(n)]
        sampling = SamplingOptions(spec.temperature, 0, 1.0, spec.max_new_tokens, stop_ids)
        sampled = engine.generate([p for p in mine for _ in range(n)], seeds, sampling)
    finally:
        if own:
            engines.close()
    return (
        gather_shards(completions(tokenizer, greedy.tokens, 1), state),  # the engine cut them at the stop
        gather_shards(completions(tokenizer, sampled.tokens, n), state),
    )


def score_prompts(
    model,
    tokenizer,
    rows: list[dict],
    spec: GenerationSpec,
    state: Any | None = None,
    engines: ReusedEngine | None = None,
) -> list[PromptResult]:
    """Greedy and ``num_samples`` sampled completions of every prompt, same seeds for every model,
    by the spec's backend: the model's ``generate`` or a vLLM engine (``engines``' when given), sharded
    over the processes of ``state`` (:func:`generate_completions`, :func:`engine_completions`)."""
    prompts = [r["prompt_ids"] for r in rows]
    evaluation_generation(spec.max_new_tokens).check(map(len, prompts), model_context(model))
    if spec.backend == "vllm":
        require_vllm()
        greedy, sampled = engine_completions(model, tokenizer, prompts, spec, engines, state)
    else:
        greedy = generate_completions(
            model, tokenizer, prompts, do_sample=False, num_return_sequences=1, spec=spec, state=state
        )
        sampled = generate_completions(
            model, tokenizer, prompts, do_sample=True, num_return_sequences=spec.num_samples, spec=spec, state=state
        )
    return [
        PromptResult(
            tokenizer.decode(row["prompt_ids"], skip_special_tokens=False),
            row["answer"],
            g[0],
            s,
            tuple(row["prompt_ids"]),
        )
        for row, g, s in zip(rows, greedy, sampled)
    ]


def per_prompt_scores(results: list[PromptResult], pass_ks: list[int]) -> dict[str, list[float]]:
    """Each prompt's greedy correctness, sampled accuracy (mean@N) and pass@k (k ≤ N): the values
    the metrics average, and what a paired comparison of two models resamples."""
    n = len(results[0].samples)
    scores = {
        ANSWER_METRICS[0]: [float(r.greedy_correct) for r in results],
        ANSWER_METRICS[1]: [sum(r.samples_correct) / n for r in results],
    }
    for k in (k for k in pass_ks if k <= n):
        scores[f"pass_at_{k}"] = [pass_at_k(n, sum(r.samples_correct), k) for r in results]
    return scores


def answer_metrics(
    results: list[PromptResult], pass_ks: list[int], seed: int, resamples: int = 1000
) -> dict[str, float]:
    """Greedy accuracy, ``sampled_accuracy`` (mean@N) and pass@k, each with a bootstrap 95% CI
    over prompts, plus the mean sampled completion length in tokens."""
    metrics: dict[str, float] = {}
    for name, values in per_prompt_scores(results, pass_ks).items():
        low, high = bootstrap_ci(values, seed, resamples)
        metrics |= {name: sum(values) / len(values), f"{name}_ci_low": low, f"{name}_ci_high": high}
    n = len(results[0].samples)
    metrics["mean_completion_tokens"] = sum(s.num_tokens for r in results for s in r.samples) / (n * len(results))
    return metrics


@torch.no_grad()
def preference_rewards(
    model,
    tokenizer,
    rows: list[dict],
    beta: float,
    batch_size: int = 256,
    state: Any | None = None,
    padding_free: PaddingFree = "auto",
) -> dict[str, float]:
    """Held-out implicit-reward accuracy and margin β·Δ against the cached ``ref_*`` log-probs, and
    the β-free log-ratio margin Δ = (π_c − ref_c) − (π_r − ref_r), comparable across runs of any β.
    Batches go to the model's device; with ``state`` each process scores its share of the batches
    and the per-batch sums are added in batch order, as one process adds them."""
    model.eval()
    collate, packing = PreferenceCollator(tokenizer.pad_token_id), packing_for(model, padding_free)
    _, mine = local_shard(batches_of(rows, batch_size), state)
    sums = []  # per batch: metric × pairs
    for part in mine:
        batch = {name: tensor.to(model.device) for name, tensor in collate(part).items()}
        ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
        logps = completion_logps(model, ids, mask, completion, packing=packing).logps
        n = len(batch["ref_chosen_logps"])
        chosen, rejected = logps[:n] - batch["ref_chosen_logps"], logps[n:] - batch["ref_rejected_logps"]
        metrics = reward_metrics(beta * chosen, beta * rejected) | {"logratios/margins": (chosen - rejected).mean()}
        sums.append({name: metrics[name].item() * n for name in PREFERENCE_METRICS})
    totals = dict.fromkeys(PREFERENCE_METRICS, 0.0)
    for batch_sums in gather_shards(sums, state):
        for name in totals:
            totals[name] += batch_sums[name]
    return {name: value / len(rows) for name, value in totals.items()}


def samples_table(results: list[PromptResult], rows: int) -> dict[str, list]:
    """First ``rows`` prompts (as rendered, special tokens included, as GRPO's completion tables
    show them) with their first sample; the reward is the task's exact-match score."""
    shown = results[:rows]
    correct = [r.samples_correct[0] for r in shown]
    return {
        "prompt": [r.prompt for r in shown],
        "answer": [r.answer for r in shown],
        "completion": [r.samples[0].text for r in shown],
        "reward": [float(c) for c in correct],
        "correct": correct,
    }


@dataclass(frozen=True)
class RewardModelSource:
    """``evaluation.reward_model`` as an evaluation loads it: a saved reward model at ``revision``, in
    ``dtype``, scoring padding-free as ``padding_free`` says (``compute.padding_free``)."""

    path: str
    revision: str | None
    dtype: str
    padding_free: PaddingFree = "auto"

    def load(self, device) -> RewardModelScorer:
        return load_scorer(self.path, self.revision, self.dtype, device, "evaluation.reward_model", self.padding_free)


def check_scorer_reads(tokenizer: PreTrainedTokenizerBase, scorer: RewardModelScorer, path: str) -> None:
    check_same_vocabulary(
        tokenizer, scorer.tokenizer, f"evaluation.reward_model {path}", "it scores the models' sampled token ids"
    )


def reward_model_scores(
    scorer: RewardModelScorer, results: list[PromptResult], batch_size: int, state: Any | None = None
) -> list[float]:
    """Each prompt's mean score of its sampled completions (prompt and sampled token ids, the stop
    token included) by ``scorer``; with ``state`` each process scores its share of the batches."""
    sequences = [(r.prompt_ids, s.token_ids) for r in results for s in r.samples]
    _, mine = local_shard(batches_of(sequences, batch_size), state)
    scores = [score for part in mine for score in scorer.score_ids(part)]
    flat = [score for part in gather_shards([scores], state) for score in part]
    n = len(results[0].samples)
    return [sum(flat[i : i + n]) / n for i in range(0, len(flat), n)]


def evaluate_model(
    model,
    tokenizer,
    prompts: list[dict],
    pairs: list[dict] | None,
    spec: EvaluationSpec,
    beta: float | None,
    state: Any | None = None,
    reward_model: RewardModelScorer | None = None,
    engines: ReusedEngine | None = None,
) -> ModelScores:
    """Every metric of one model: answer metrics of ``prompts`` (with their samples table and
    per-prompt values), the ``reward_model``'s mean score of its samples, implicit rewards at
    ``beta`` of ``pairs`` (rows with ``ref_*`` log-probs), and the harness's metrics of ``spec.suites``.
    With ``state`` (a launch's ``PartialState``) the work is sharded over its processes and every
    process returns what one process would; ``engines`` is the vLLM engine the models of an evaluation
    share (with the ``vllm`` backend and none given, one for this model: its completions and suites share it)."""
    vllm = spec.generation.backend == "vllm"
    if vllm and engines is None:
        require_vllm()
        with evaluation_engine(spec.generation.seed) as own:
            return evaluate_model(model, tokenizer, prompts, pairs, spec, beta, state, reward_model, own)
    scores = ModelScores({}, {}, {})
    if prompts:
        results = score_prompts(model, tokenizer, prompts, spec.generation, state, engines)
        pass_k = list(spec.pass_k)
        scores = ModelScores(
            answer_metrics(results, pass_k, spec.generation.seed, spec.bootstrap_resamples),
            samples_table(results, spec.num_logged_samples),
            per_prompt_scores(results, pass_k),
        )
        if reward_model is not None:
            values = reward_model_scores(reward_model, results, spec.pair_batch_size, state)
            low, high = bootstrap_ci(values, spec.generation.seed, spec.bootstrap_resamples)
            scores.metrics.update(
                {
                    REWARD_MODEL_METRIC: sum(values) / len(values),
                    f"{REWARD_MODEL_METRIC}_ci_low": low,
                    f"{REWARD_MODEL_METRIC}_ci_high": high,
                }
            )
            scores.per_prompt[REWARD_MODEL_METRIC] = values
    if pairs:
        if beta is None:
            raise ValueError("held-out pairs are scored by their implicit rewards, which need a beta")
        scores.metrics.update(
            preference_rewards(model, tokenizer, pairs, beta, spec.pair_batch_size, state, spec.padding_free)
        )
    if spec.suites:
        llm = engines.serving(model).llm if vllm and engines is not None else None
        suites = harness_scores(model, tokenizer, spec.suites, spec.generation.seed, state, llm)
        scores.metrics.update(suites.metrics)
        scores.per_prompt.update(suites.per_prompt)
    return scores


def evaluate_models(
    models: Iterable[M],
    load: Callable[[M], tuple[PreTrainedModel, PreTrainedTokenizerBase, list[dict] | None]],
    prompts: list[dict],
    spec: EvaluationSpec,
    beta: float | None,
    state: Any | None = None,
    reward_model: RewardModelSource | None = None,
    engines: ReusedEngine | None = None,
) -> Iterator[ModelScores]:
    """:func:`evaluate_model` of each of ``models`` in turn, as ``load`` gives it (the model, its
    tokenizer and the held-out pairs it is scored on, None for none): each model is let go before
    the next is loaded. The reward model is loaded once, on the first model's device, and must read
    every model's token ids."""
    scorer = None
    for item in models:
        model, tokenizer, pairs = load(item)
        if reward_model is not None:
            if scorer is None:
                scorer = reward_model.load(model.device)
            check_scorer_reads(tokenizer, scorer, reward_model.path)
        scores = evaluate_model(model, tokenizer, prompts, pairs, spec, beta, state, scorer, engines)
        del model, tokenizer  # before the next model is loaded
        yield scores
