"""The standard suites' tasks (GSM8K, MMLU, …, and users' own task YAML files) scored by
lm-evaluation-harness itself, on the model the evaluation already loaded.

A suite task is resolved once per evaluation (:func:`resolve_suite`): its YAML config as the harness
builds it, with its dataset pointed at local files where the config says so, checked to need no
download, and fingerprinted by its config, its data files' contents and the harness's version. Its
metrics are the harness's, named ``<task>/<metric>/<filter>`` (its ``exact_match,strict-match``
becomes ``gsm8k/exact_match/strict-match``: MLflow's metric names hold no commas), with the
standard errors beside them as ``<task>/<metric>_stderr/<filter>``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BUILTIN_ADDITION = "builtin:addition"
BUILTIN_TASK_FILES = {BUILTIN_ADDITION: Path(__file__).with_name("harness_tasks") / "addition.yaml"}
# Tasks whose prompts the pipeline trains on as plain text (``trainers.data.rows.render_prompt`` of a
# string): the harness renders them so too, not with the chat template.
PLAIN_TEXT_TASKS = frozenset({BUILTIN_ADDITION})
# ``datasets`` builders that read local files (``dataset_kwargs.data_files``) and never the hub
LOCAL_BUILDERS = ("json", "csv", "parquet", "arrow", "text")
OFFLINE_HINT = (
    "give the task local data: `dataset: {path: json|csv|parquet|arrow|text, data_files: {<split>: <file>}}` or "
    "`dataset: {path: <a local copy of the hub dataset's folder>}` (docs/evaluation.md: Suites offline), or set "
    "`download: true` on a machine that reaches the hub"
)


class SuiteError(ValueError):
    """A suite task that cannot be run as configured, named by its place in ``evaluation.suites``."""


@dataclass(frozen=True)
class SuiteData:
    """Where a suite task's documents come from instead of its config's ``dataset_path``: a
    ``datasets`` builder (``json``, ``parquet``, …) with ``data_files`` (split → file), or a local folder."""

    path: str
    data_files: Mapping[str, str] | None = None
    name: str | None = None


@dataclass(frozen=True)
class SuiteRequest:
    """One entry of ``evaluation.suites`` as the trainers take it (``SuiteTask.request``)."""

    task: str  # a task of the harness's registry, a task YAML file, or ``builtin:addition``
    where: str  # e.g. ``evaluation.suites[0]``: what an error names
    dataset: SuiteData | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 16
    apply_chat_template: bool | None = None  # None: where the tokenizer has a chat template
    download: bool = False


@dataclass(frozen=True)
class HarnessTask:
    """A suite task ready to run: ``config`` is its whole task config (``!function`` tags imported),
    ``fingerprint`` what its scores depend on besides the model."""

    name: str
    config: dict[str, Any] = field(repr=False)
    fingerprint: str
    request: SuiteRequest


def harness_version() -> str:
    return metadata.version("lm_eval")


def task_file(request: SuiteRequest) -> Path:
    """The YAML file that defines ``request.task``."""
    if request.task in BUILTIN_TASK_FILES:
        return BUILTIN_TASK_FILES[request.task]
    if request.task.endswith((".yaml", ".yml")):
        path = Path(request.task).expanduser().resolve()
        if not path.is_file():
            raise SuiteError(f"{request.where}.task: no task file {path}")
        return path
    from trainers.evaluation.lm_eval_compat import registered_task_file

    found = registered_task_file(request.task)
    if found is None:
        raise SuiteError(
            f"{request.where}.task: {request.task!r} is no task of lm-eval {harness_version()} (a group or tag: list "
            "its tasks one by one), nor a task YAML file (a path ending in .yaml)"
        )
    return found


def with_data(config: dict[str, Any], data: SuiteData) -> dict[str, Any]:
    """``config`` reading its documents from ``data`` (paths made absolute)."""
    changed = {**config, "dataset_path": data.path}
    changed.pop("dataset_name", None)
    if data.name is not None:
        changed["dataset_name"] = data.name
    kwargs = dict(config.get("dataset_kwargs") or {})
    if data.data_files is not None:
        kwargs["data_files"] = {split: str(Path(f).expanduser().resolve()) for split, f in data.data_files.items()}
    else:
        kwargs.pop("data_files", None)
    changed["dataset_kwargs"] = kwargs
    if Path(data.path).expanduser().exists():
        changed["dataset_path"] = str(Path(data.path).expanduser().resolve())
    return changed


def data_files(config: Mapping[str, Any]) -> list[Path]:
    """The local files ``config``'s dataset reads: its ``data_files``, or every file of a local folder."""
    path = Path(str(config.get("dataset_path", "")))
    if config.get("dataset_path") not in LOCAL_BUILDERS and path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and ".git" not in p.parts)
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    listed = files.values() if isinstance(files, Mapping) else [files]
    return [Path(f) for entry in listed for f in (entry if isinstance(entry, list) else [entry])]


def check_local(config: Mapping[str, Any], request: SuiteRequest) -> None:
    """Refuse a task whose documents would be downloaded (unless ``request.download``), or whose
    local data files are missing, naming the task and what to provide."""
    source = config.get("dataset_path")
    name = config.get("task", request.task)
    if source is None:
        return  # a custom_dataset function: the user's code reads what it reads
    if source in LOCAL_BUILDERS:
        files = data_files(config)
        if not files:
            raise SuiteError(f"{request.where} ({name}): dataset_path {source} reads data_files, and none are given")
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SuiteError(f"{request.where} ({name}): data file(s) not found: {', '.join(missing)}")
    elif not Path(str(source)).is_dir() and not request.download:
        raise SuiteError(
            f"{request.where} ({name}): its data is the hub dataset {source!r}, which would be downloaded while the "
            f"models are scored; {OFFLINE_HINT}"
        )


def placeless(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without where its local data lies (a fingerprint hashes the files' contents)."""
    kwargs = {k: v for k, v in (config.get("dataset_kwargs") or {}).items() if k != "data_files"}
    local_folder = config.get("dataset_path") not in LOCAL_BUILDERS and Path(str(config.get("dataset_path"))).is_dir()
    return {**config, "dataset_kwargs": kwargs} | ({"dataset_path": "local folder"} if local_folder else {})


def resolve_suite(request: SuiteRequest, folder: Path, held_out: Sequence[Mapping[str, str]] = ()) -> HarnessTask:
    """``request`` ready to run (:class:`HarnessTask`): ``builtin:addition`` scores ``held_out``
    (``prompt`` / ``answer`` rows, written to ``folder``), the others their config's data or
    ``request.dataset``. Raises :class:`SuiteError` naming the entry where the task or its data cannot
    be had without a download."""
    from trainers.evaluation.lm_eval_compat import task_yaml
    from trainers.runtime.checkpoints import file_sha256

    path = task_file(request)
    data = request.dataset
    if request.task == BUILTIN_ADDITION:
        if not held_out:
            raise SuiteError(f"{request.where}: {BUILTIN_ADDITION} scores the built-in task's held-out prompts: none")
        # no brackets in the name: ``datasets`` reads data_files as glob patterns
        rows = folder / f"{re.sub(r'[^A-Za-z0-9_-]+', '-', request.where)}addition.jsonl"
        rows.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in held_out))
        data = SuiteData("json", {"test": str(rows)})
    raw, runnable = task_yaml(path, resolve_functions=False), task_yaml(path, resolve_functions=True)
    if data is not None:
        raw, runnable = with_data(raw, data), with_data(runnable, data)
    if "task" not in raw:
        raise SuiteError(f"{request.where}: {path} defines no `task` (a group's file: list its tasks one by one)")
    check_local(raw, request)
    hashed = {
        "config": placeless(raw),
        "data": [file_sha256(f) for f in data_files(raw)],  # contents, not where they lie
        "lm_eval": harness_version(),
    }
    fingerprint = hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()
    return HarnessTask(str(raw["task"]), runnable, fingerprint, request)


@dataclass(frozen=True)
class HarnessScores:
    """A model's suite metrics (``<task>/<metric>/<filter>``, standard errors as
    ``<task>/<metric>_stderr/<filter>``) and the per-document values of those the harness averages."""

    metrics: dict[str, float]
    per_prompt: dict[str, list[float]]


def metric_name(task: str, key: str) -> str | None:
    """The pipeline's name of the harness's result ``key`` (``exact_match,strict-match``); None for
    what is no metric (``alias``, ``sample_len``)."""
    metric, comma, filter_name = key.partition(",")
    return f"{task}/{metric}/{filter_name}" if comma else None


def suite_metric_parts(name: str) -> tuple[str, str, str] | None:
    """``(task, metric, filter)`` of a name of the suites' shape, ``<task>/<metric>/<filter>``; None for another."""
    parts = name.split("/")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 and all(parts) else None


def is_suite_metric(name: str) -> bool:
    """Whether ``name`` is a suite metric (``<task>/<metric>/<filter>``), not its standard error."""
    parts = suite_metric_parts(name)
    return parts is not None and not parts[1].endswith("_stderr")


def stderr_name(name: str) -> str | None:
    """``<task>/<metric>_stderr/<filter>``: the harness's standard error of the suite metric ``name``;
    None for a name of another shape."""
    parts = suite_metric_parts(name)
    return None if parts is None else f"{parts[0]}/{parts[1]}_stderr/{parts[2]}"


def averaged_metrics(config: Mapping[str, Any]) -> set[str]:
    """The metrics of ``config`` aggregated by their mean: their per-document values are the ones a
    paired comparison resamples."""
    return {m["metric"] for m in config.get("metric_list") or [] if m.get("aggregation") == "mean"}


def run_task(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: HarnessTask,
    seed: int,
    state: Any | None = None,
    llm: Any | None = None,
) -> dict | None:
    """``simple_evaluate``'s output for ``task`` on ``model`` (the harness's HF wrapper around the
    instance, or with ``llm``, a vLLM engine holding its weights, the harness's vLLM backend over it;
    with ``tokenizer`` and its chat template where the request asks for it, or by default where the
    tokenizer has one and the task is no :data:`PLAIN_TEXT_TASKS`'), every seed the harness takes set
    to ``seed``. With ``state`` (a launch's ``PartialState``) each process runs its share of the
    requests and the first process gets the output, the others None."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    request, chat = task.request, task.request.apply_chat_template
    if llm is None:
        from trainers.evaluation.lm_eval_compat import harness_lm

        lm = harness_lm(model, tokenizer, request.batch_size, state)
    else:
        from trainers.evaluation.lm_eval_vllm import EngineLM  # vLLM's environment only

        lm = EngineLM(llm, model, tokenizer, request.batch_size, state)
    if chat is None:
        chat = request.task not in PLAIN_TEXT_TASKS and bool(tokenizer.chat_template)
    return simple_evaluate(
        model=lm,
        tasks=[task.config],
        task_manager=TaskManager(include_defaults=False),
        num_fewshot=request.num_fewshot,
        limit=request.limit,
        apply_chat_template=chat,
        log_samples=True,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def harness_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[HarnessTask],
    seed: int,
    state: Any | None = None,
    llm: Any | None = None,
) -> HarnessScores:
    """Every suite task's metrics of ``model``, as the harness computes them (:func:`run_task`, on the
    vLLM engine ``llm`` where given); with ``state`` over its processes, every process getting the first one's."""
    from trainers.runtime.work_split import from_first

    scores = HarnessScores({}, {})
    for task in tasks:
        output = run_task(model, tokenizer, task, seed, state, llm)
        if output is not None:
            add_task_scores(scores, task, output)
    return from_first(scores if state is None or state.is_main_process else None, state)


def add_task_scores(scores: HarnessScores, task: HarnessTask, output: dict) -> None:
    """``output``'s (``simple_evaluate``'s) metrics of ``task`` into ``scores``."""
    averaged = averaged_metrics(task.config)
    for key, value in output["results"][task.name].items():
        name = metric_name(task.name, key)
        if name is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a standard error the harness could not compute is "N/A"
        scores.metrics[name] = float(value)
        metric, _, filter_name = key.partition(",")
        if metric in averaged:
            documents = sorted(
                (s for s in output["samples"][task.name] if s["filter"] == filter_name), key=lambda s: s["doc_id"]
            )
            scores.per_prompt[name] = [float(s[metric]) for s in documents]
