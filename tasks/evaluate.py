"""Evaluation of several models on the same held-out prompts, pairs and seeds."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import datasets
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel

from infra.core.config import AdditionTaskConfig, ComputeConfig, EvaluationConfig, compute_device
from infra.core.fingerprints import atomic_directory, code_fingerprint, hash_value
from infra.core.handles import ModelHandle, PreparedData, ReferenceLogps
from infra.core.settings import get_settings
from infra.core.stage_io import EvaluatedModel, EvaluateJob, StageFolder
from tasks.launch import launch
from tasks.mlflow_runs import client, log_metrics
from tasks.reference import with_reference_columns
from tasks.tracking import stage_run_id, tracked_run
from trainers.evaluation.harness import HarnessTask, is_suite_metric, stderr_name
from trainers.models.devices import load_dtype
from trainers.scoring.metrics import ModelScores

if TYPE_CHECKING:
    from trainers.generation.vllm_engine import ReusedEngine

# Shown in the printed table; every metric (CIs, pass@k, lengths) goes to MLflow.
TABLE_COLUMNS = {
    "greedy_accuracy": "greedy acc",
    "sampled_accuracy": "sampled acc",
    "pass_at_4": "pass@4",
    "mean_completion_tokens": "mean tokens",
    "rewards/accuracies": "reward acc",  # the implicit reward β·log(π/ref) of the last stage with a β (DPO, KTO)
    "rewards/margins": "reward margin",
    "logratios/margins": "log-ratio margin",
    "reward_model_score": "RM score",
}


NOTHING_EVALUATED = (
    "Nothing was evaluated: no held-out prompts (`data.eval_prompts` or the built-in task) and no held-out "
    "pairs (`data.preference_eval` and a stage with cached reference log-probs)."
)


class HeldOutRewards(BaseModel):
    """Implicit rewards β·(π − ref) on the held-out pairs: the reference's cached log-probs and β."""

    reference_logps: ReferenceLogps
    beta: float


class EvalReport(BaseModel):
    rows: dict[str, dict[str, float]]  # model label -> metric -> value; a metric a model lacks is absent
    num_prompts: int
    num_pairs: int
    mlflow_run_id: str
    # model label -> metric -> one value per held-out prompt (same prompts, same order for every model)
    per_prompt: dict[str, dict[str, list[float]]] = {}
    suite_metrics: list[str] = []  # the suites' metrics (``<task>/<metric>/<filter>``), shown after TABLE_COLUMNS

    def summary(self) -> str:
        """What the flows print: the table, or that there was nothing to evaluate."""
        if not self.num_prompts and not self.num_pairs and not self.suite_metrics:
            return NOTHING_EVALUATED
        return f"Evaluation ({self.num_prompts} held-out prompts, {self.num_pairs} held-out pairs):\n{self.markdown()}"

    def columns(self) -> dict[str, str]:
        """Metric → column title of the table: :data:`TABLE_COLUMNS` any model has, then the suites'."""
        shown = {c: title for c, title in TABLE_COLUMNS.items() if any(c in m for m in self.rows.values())}
        return shown | {name: name for name in self.suite_metrics}

    def markdown(self) -> str:
        titles = self.columns()
        columns = list(titles)
        lines = ["| model | " + " | ".join(titles.values()) + " |", "|---" * (len(columns) + 1) + "|"]
        for label, metrics in self.rows.items():
            lines.append(f"| {label} | " + " | ".join(format_cell(metrics, c) for c in columns) + " |")
        return "\n".join(lines) + "\n"


def format_cell(metrics: dict[str, float], name: str) -> str:
    """A metric with its 95% CI, or a suite metric ± its standard error, where the model has them."""
    if name not in metrics or math.isnan(metrics[name]):
        return "—"
    low, high = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    interval = f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None else ""
    stderr = metrics.get(spread_name) if (spread_name := stderr_name(name)) is not None else None
    spread = f" ± {stderr:.3f}" if stderr is not None and not math.isnan(stderr) else ""
    return f"{metrics[name]:.3f}{interval}{spread}"


def suite_metrics(rows: dict[str, dict[str, float]], suites: Sequence[HarnessTask]) -> list[str]:
    """The suites' metrics in the rows, standard errors left out (they are shown beside their metric)."""
    prefixes = tuple(f"{task.name}/" for task in suites)
    return sorted({name for m in rows.values() for name in m if name.startswith(prefixes) and is_suite_metric(name)})


def check_suites(config: EvaluationConfig, builtin: AdditionTaskConfig | None) -> None:
    """Refuse, before any stage trains or any model is scored, a suite task that cannot run here."""
    if config.suites:
        with tempfile.TemporaryDirectory(prefix="suites-") as folder:
            config.resolved_suites(builtin, Path(folder))


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What the models of one evaluation are scored on and with: the held-out prompts and the pairs
    (with their reference log-probs), the evaluation settings, the implicit reward's β, where it runs,
    the reward model that scores the samples, the reference (its fingerprint), which is scored
    without the pairs: its implicit reward is 0 by definition, the chat template the data was
    prepared with when it overrides the tokenizers' (:attr:`PreparedData.chat_template`), and the
    config's plugins, which a launched evaluation imports first (a reward head may be theirs)."""

    prompts: list[dict]
    pairs: list[dict] | None
    config: EvaluationConfig
    beta: float | None
    compute: ComputeConfig
    reward_model: ModelHandle | None = None
    reference: str | None = None
    chat_template: str | None = None
    plugins: tuple[str, ...] = ()
    suites: tuple[HarnessTask, ...] = ()
    builtin: AdditionTaskConfig | None = None  # ``data.builtin``, which the suites' were resolved from

    def pairs_of(self, handle: ModelHandle) -> list[dict] | None:
        return None if handle.fingerprint == self.reference else self.pairs


def score_model(handle: ModelHandle, scoring: Scoring, engines: ReusedEngine | None = None) -> ModelScores:
    """Every metric of one model (:func:`score_models`)."""
    (scores,) = score_models([handle], scoring, engines)
    return scores


def score_models(
    handles: list[ModelHandle], scoring: Scoring, engines: ReusedEngine | None = None
) -> Iterator[ModelScores]:
    """Every metric of each model in turn, as each is scored (``trainers.evaluation.evaluate.evaluate_model``),
    loaded in ``compute.dtype`` on this machine's GPU where there is one (unless ``compute.cpu``),
    the reward model scoring their samples and ``engines`` (:func:`shared_engine`) generating them
    with vLLM; or, over ``compute.num_processes``, launched (:func:`launched_scores`) with the same result."""
    if scoring.compute.num_processes > 1:
        yield from launched_scores(handles, scoring)
        return
    from trainers.evaluation.evaluate import RewardModelSource, evaluate_models
    from trainers.models.pretrained import load_causal_lm

    compute, rm, device = scoring.compute, scoring.reward_model, compute_device(scoring.compute.cpu)

    def load(handle: ModelHandle):
        loaded = load_causal_lm(handle.path, handle.revision, compute.dtype, device, scoring.chat_template)
        return (*loaded, scoring.pairs_of(handle))

    source = None if rm is None else RewardModelSource(rm.path, rm.revision, compute.dtype, compute.padding_free)
    yield from evaluate_models(
        handles,
        load,
        scoring.prompts,
        scoring.config.spec(compute.padding_free, scoring.suites),
        scoring.beta,
        None,
        source,
        engines,
    )


def launched_scores(handles: list[ModelHandle], scoring: Scoring) -> Iterator[ModelScores]:
    """:func:`score_models` by :class:`EvaluateJob` launches, each launch's scores as it ends: the
    rows go to a launch folder (on the state folder's storage, which every machine reads), each
    process scores its share of each model's batches. One launch scores every model; on vLLM a launch
    ends at the first model of another shape than its engine's (``tasks.launched_rank.evaluate``),
    and the next launch starts from there."""
    launches = get_settings().launches
    launches.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="evaluate-", dir=launches))  # evaluations may run side by side
    try:
        rows = {EvaluateJob.PROMPTS: scoring.prompts, EvaluateJob.PAIRS: scoring.pairs}
        datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in rows.items() if r}).save_to_disk(
            folder / "rows"
        )
        remaining = handles
        while remaining:
            job = evaluate_job(remaining, scoring, folder)
            scores = launch(job, f"evaluation of {', '.join(h.stage for h in remaining)}").scores
            if not scores:  # the first model of a launch builds its engine: never the case
                raise RuntimeError(f"a launched evaluation scored none of {[h.stage for h in remaining]}")
            yield from scores
            remaining = remaining[len(scores) :]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def evaluate_job(handles: list[ModelHandle], scoring: Scoring, folder: Path) -> EvaluateJob:
    """The launched evaluation of ``handles`` on the rows written to ``folder`` (:func:`launched_scores`)."""
    return EvaluateJob(
        plugins=scoring.plugins,
        launch_dir=folder / "launch",
        models=[
            EvaluatedModel(model=h.path, revision=h.revision, pairs=scoring.pairs_of(h) is not None) for h in handles
        ],
        splits=folder / "rows",
        compute=scoring.compute,
        evaluation=scoring.config,
        beta=scoring.beta,
        reward_model=scoring.reward_model,
        chat_template=scoring.chat_template,
        builtin=scoring.builtin,
    )


SCORES_FILE = "scores.json"


def scores_key(
    handle: ModelHandle,
    data: PreparedData,
    pairs_from: ReferenceLogps | None,
    config: EvaluationConfig,
    beta,
    dtype: str = "float32",
    reward_model: ModelHandle | None = None,
    plugins: Sequence[str] = (),
    suites: Sequence[HarnessTask] = (),
) -> str:
    """What a model's scores are a function of: its weights and tokenizer, the dtype it runs in, the
    prepared held-out prompts (and pairs with their reference log-probs), the evaluation settings,
    the reward model that scores its samples, the suite tasks (their configs, data and harness
    version) and the code (the ``plugins``' among it: a reward head may be theirs)."""
    return hash_value(
        {
            "dtype": dtype,
            # weights and tokenizer, not the run-specific files beside them (training_args.bin)
            "model": [handle.weights_fingerprint or handle.fingerprint, handle.tokenizer_fingerprint],
            "data": data.fingerprint,
            "pairs": None if pairs_from is None else {"reference_logps": pairs_from.key, "beta": beta},
            "evaluation": config.model_dump(mode="json"),
            "code": code_fingerprint(__name__, *plugins),
            # absent without one, so other keys stay as they were
            **({"reward_model": reward_model.weights_fingerprint or reward_model.fingerprint} if reward_model else {}),
            **({"suites": [task.fingerprint for task in suites]} if suites else {}),
        }
    )


def cached_scores(
    handles: list[ModelHandle], scoring: Scoring, keys: list[str], engines: ReusedEngine | None = None
) -> list[ModelScores]:
    """:func:`score_models`, each model's scores computed once per content key (``keys``, in the
    models' order) under the evaluation cache: a model evaluated again, e.g. the champion or an
    unchanged stage, is neither loaded nor run; the others are scored together, each entry written
    as its model's scores arrive."""
    found = {key: entry for key in keys if (entry := cached_entry(key)) is not None}
    missing = {key: handle for handle, key in zip(handles, keys) if key not in found}  # a key once
    if missing:
        for key, scores in zip(missing, score_models(list(missing.values()), scoring, engines), strict=True):
            with atomic_directory(get_settings().eval_cache / key) as staging:
                content = dataclasses.asdict(scores)
                (staging / SCORES_FILE).write_text(json.dumps({"sha256": hash_value(content), "scores": content}))
            found[key] = scores
    return [found[key] for key in keys]


def cached_entry(key: str) -> ModelScores | None:
    """The evaluation cache's scores under ``key``; None where there are none, or none to trust (an
    unreadable entry is removed, to be scored again)."""
    folder = get_settings().eval_cache / key
    try:
        return read_scores(folder / SCORES_FILE)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as problem:
        get_run_logger().warning("evaluation cache entry %s is unreadable (%s): scoring again", folder, problem)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def read_scores(path: Path) -> ModelScores:
    """A cache entry's scores, checked against the digest written with them: an entry edited or
    corrupted since (it would change a model's row and the promotion gate's view) is a ValueError."""
    stored = json.loads(path.read_text())
    if hash_value(stored["scores"]) != stored["sha256"]:
        raise ValueError(f"{SCORES_FILE} does not match its sha256: changed since it was written")
    return ModelScores(**stored["scores"])


@contextmanager
def shared_engine(config: EvaluationConfig) -> Iterator[ReusedEngine | None]:
    """With ``generation_backend: vllm``, the engine the evaluation's models share (built for the
    first model that is scored, synced for the next ones), closed at the end; None with ``hf``."""
    if config.generation_backend != "vllm":
        yield None
        return
    from trainers.evaluation.evaluate import evaluation_engine  # torch and vLLM, only where vLLM generates

    with evaluation_engine(config.seed) as engines:
        yield engines
        if engines.models:
            get_run_logger().info(f"evaluation on vLLM: {engines.builds} engine(s) built for {engines.models} model(s)")


# log_prints off: the rows of a launched evaluation are written with datasets, whose dill prints a
# bytecode listing that Prefect's print capture would log (see tasks.data.prepare_dataset).
@task(name="evaluate", log_prints=False)
def evaluate(
    models: dict[str, ModelHandle],
    data: PreparedData,
    held_out_rewards: HeldOutRewards | None,
    config: EvaluationConfig,
    parent_run_id: str,
    config_name: str,
    final_label: str | None = None,
    compute: ComputeConfig = ComputeConfig(),  # noqa: B008 (frozen)
    reward_model: ModelHandle | None = None,
    plugins: Sequence[str] = (),
    builtin: AdditionTaskConfig | None = None,
) -> EvalReport:
    """Score every model; implicit-reward metrics skip the reference itself (its margin is 0 by
    definition); ``reward_model`` (``evaluation.reward_model``, resolved) scores every model's
    samples; the suites score it too (``builtin:addition`` on ``builtin``'s held-out problems,
    ``data.builtin``). ``final_label``'s metrics are also logged on the parent run as ``final/<metric>``.
    A launched evaluation imports ``plugins`` (the config's) first."""
    prepared = datasets.load_from_disk(data.path)
    prompts = prepared["eval_prompts"].to_list()[: config.num_prompts] if "eval_prompts" in prepared else []
    pairs, reference_logps, reference_fingerprint, beta = None, None, None, None
    if held_out_rewards is not None:
        reference_logps = held_out_rewards.reference_logps
        with_reference = with_reference_columns(reference_logps)
        held_out = with_reference.get("preference_eval")
        pairs = None if held_out is None else held_out if isinstance(held_out, list) else held_out.to_list()
        reference_fingerprint, beta = reference_logps.reference_fingerprint, held_out_rewards.beta

    if not prompts and not pairs and not config.suites:
        get_run_logger().warning(NOTHING_EVALUATED)
    # an evaluation is not resumed: one folder (and MLflow run) per flow run
    run_id = stage_run_id(
        parent_run_id, "evaluate", StageFolder.of(config_name, "evaluate", str(flow_run.get_id() or "local"))
    )
    with tempfile.TemporaryDirectory(prefix="suites-") as suite_folder:  # the suites' generated data
        suites = config.resolved_suites(builtin, Path(suite_folder))  # before any model is scored
        scoring = Scoring(
            prompts,
            pairs,
            config,
            beta,
            compute,
            reward_model,
            reference=reference_fingerprint,
            chat_template=data.chat_template,
            plugins=tuple(plugins),
            suites=suites,
            builtin=builtin,
        )
        keys = [
            scores_key(
                model,
                data,
                reference_logps if scoring.pairs_of(model) else None,
                config,
                beta,
                load_dtype(model.path, model.revision, compute.dtype),
                reward_model,
                plugins,
                suites,
            )
            for model in models.values()
        ]
        rows, per_prompt = {}, {}
        with tracked_run(run_id), shared_engine(config) as engines:
            for label, scores in zip(models, cached_scores(list(models.values()), scoring, keys, engines)):
                rows[label], per_prompt[label] = scores.metrics, scores.per_prompt
                log_metrics(run_id, {f"{label}/{name}": value for name, value in rows[label].items()})
                log_metrics(parent_run_id, {f"eval/{label}/{name}": value for name, value in rows[label].items()})
                if scores.samples:
                    client().log_table(run_id, data=scores.samples, artifact_file=f"samples/{label}.json")
            if final_label is not None:
                log_metrics(parent_run_id, {f"final/{name}": value for name, value in rows[final_label].items()})
                client().set_tag(parent_run_id, "alignflow.final_stage", final_label)
            report = EvalReport(
                rows=rows,
                num_prompts=len(prompts),
                num_pairs=len(pairs or []),
                mlflow_run_id=run_id,
                per_prompt=per_prompt,
                suite_metrics=suite_metrics(rows, suites),
            )
            columns = [*TABLE_COLUMNS, *report.suite_metrics]
            client().log_table(
                run_id,
                data={"model": list(rows), **{c: [m.get(c) for m in rows.values()] for c in columns}},
                artifact_file="eval_table.json",
            )
            for table_run in (run_id, parent_run_id):  # the parent, found first in the UI, carries it too
                client().log_text(table_run, report.markdown(), "eval_table.md")
    create_table_artifact(
        key="evaluation",
        table=[{"model": label, **{c: round(m[c], 4) for c in columns if c in m}} for label, m in rows.items()],
        description=f"{len(prompts)} held-out prompts, {len(pairs or [])} held-out pairs",
    )
    return report
