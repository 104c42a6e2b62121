"""What several test modules share, in one place: no test module imports another.

Imported by name (``from helpers import ...``): pytest puts ``tests/`` on ``sys.path`` (the rootdir
``conftest.py``), as it does for ``killing.py``, ``fsdp_cpu.py`` and ``kto_cpu.py``, the other helper modules.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from infra.core.mlflow_compat import basic_auth_admin_from_environment, installed_version

PROJECT = Path(__file__).resolve().parents[1]
ALIGNFLOW = [sys.executable, "-m", "infra.ops.cli"]  # the `alignflow` command of this checkout
MINIMAL = "configs/minimal.yaml"
SMOKE = "alignflow-experiment/smoke"  # the deployment the session's `alignflow serve` serves (conftest.py)


# Tests of a server started with `servers up --auth`, which refuses MLflow 3.9-3.16 by design
# (pyproject's floor is 3.9; tests/test_ops.py and tests/test_compat.py test the refusal itself).
MLFLOW_VERSION = installed_version()
NEEDS_AUTH_MLFLOW = pytest.mark.skipif(
    not basic_auth_admin_from_environment(MLFLOW_VERSION),
    reason=f"`servers up --auth` refuses MLflow {MLFLOW_VERSION} (before 3.17)",
)


def model_with_context(source: str | Path, folder: Path, positions: int) -> Path:
    """A copy of the model folder ``source`` at ``folder`` whose config.json names ``positions``
    positions (a rotary model's weights and outputs do not depend on that number)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return folder


# TrainingArguments of a test trainer: no reporting, no checkpoints, no progress bars, no pinned memory.
QUIET_TRAINING = dict(report_to=[], save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)


def alignflow(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `alignflow` command of this checkout run with ``env``, from the project, output captured."""
    return subprocess.run([*ALIGNFLOW, *args], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout)


def environment_without_services(*also: str) -> dict[str, str]:
    """This process's environment without its Prefect and MLflow settings (and the variables
    starting with ``also``): a subprocess started with it derives its own from its ``ALIGNFLOW_HOME``."""
    dropped = ("PREFECT_", "MLFLOW_", *also)
    return {key: value for key, value in os.environ.items() if not key.startswith(dropped)}


def migrated_template(package: str, build: Callable[[Path], None]) -> Path:
    """A database migrated to ``package``'s head by ``build`` (given the path to write), made once per
    version of ``package`` and kept in ``.pytest_cache`` (test processes that ask at once wait for one
    build)."""
    from infra.core.locks import LocalFileLock

    template = PROJECT / ".pytest_cache" / "alignflow" / f"{package}-{importlib.metadata.version(package)}.db"
    template.parent.mkdir(parents=True, exist_ok=True)
    with LocalFileLock(template.with_suffix(".lock"), timeout=300):
        if not template.exists():
            building = template.with_suffix(".building")
            building.unlink(missing_ok=True)
            build(building)
            building.rename(template)
    return template


def upgraded_prefect_database(path: Path) -> None:
    """``prefect server database upgrade`` into ``path``."""
    with tempfile.TemporaryDirectory(dir=path.parent) as home:
        upgrade = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"]
        env = environment_without_services() | {"PREFECT_HOME": home}
        done = subprocess.run(upgrade, cwd=PROJECT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        (Path(home) / "prefect.db").rename(path)


def created_mlflow_store(path: Path) -> None:
    """An MLflow SQLite store at ``path``, created and migrated as a state folder's first command
    creates it (:func:`infra.ops.databases.create_mlflow_store`, in this process): a copy opens in
    ~0.04 s, a new store takes ~1 CPU s of migrations."""
    from infra.ops.databases import create_mlflow_store

    create_mlflow_store(f"sqlite:///{path}")


def migrated_prefect_database() -> Path:
    return migrated_template("prefect", upgraded_prefect_database)


def migrated_mlflow_database() -> Path:
    return migrated_template("mlflow", created_mlflow_store)


def with_migrated_databases(home: Path) -> Path:
    """``home`` (a state folder), its Prefect and MLflow databases copies of the migrated templates
    (tests of a new state folder's first start leave them out)."""
    database = home / "prefect" / "prefect.db"
    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_prefect_database(), database)
    shutil.copyfile(migrated_mlflow_database(), home / "mlflow.db")
    return home


def state_folder_environment(home: Path, *also: str) -> dict[str, str]:
    """The environment of an `alignflow` subprocess with the state folder ``home`` and nothing of this
    session's Prefect and MLflow settings (nor the variables starting with ``also``). ``home``'s
    databases are copies of the migrated templates (:func:`with_migrated_databases`): a temporary
    server on the Prefect one starts in ~4 CPU s, not the ~11 s of Prefect's 116 migrations on a new
    one (tests of a new state folder's first start use :func:`environment_without_services`)."""
    return environment_without_services(*also) | {"ALIGNFLOW_HOME": str(with_migrated_databases(home))}


def mlflow_client(home: Path | str | None = None):
    """The MLflow client of the session's tracking store, or of the state folder ``home``'s own
    SQLite store (a subprocess's, started with ``ALIGNFLOW_HOME=home``)."""
    from mlflow import MlflowClient

    if home is None:
        from infra.core.settings import get_settings

        return MlflowClient(get_settings().mlflow_tracking_uri)
    return MlflowClient(f"sqlite:///{Path(home) / 'mlflow.db'}")


def task_states(flow_run_id) -> dict[str, str]:
    """The state names of a flow run's task runs, by task run name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run.state.name for run in runs}


def run_flow(config):
    """The experiment flow in this process, on the session's Prefect server: (flow run id, report)."""
    from flows.pipeline import experiment

    state = experiment(config, return_state=True)
    assert state.is_completed(), state.message
    return state.state_details.flow_run_id, state.result()


def wait_for_deployment(name: str, server: subprocess.Popen, timeout: float = 180) -> None:
    """Until the Prefect API knows deployment ``name`` (served by ``server``, which must not end)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as prefect:
        while True:
            try:
                prefect.read_deployment_by_name(name)
                return
            except ObjectNotFound:
                assert server.poll() is None and time.monotonic() < deadline, f"{name} was not served"
                time.sleep(1)


# Chat templates of model families whose end of turn is not the tokenizer's EOS (a Qwen2.5 base
# model's ChatML, Llama-3's, Gemma's), for :func:`chat_tokenizer` and tests/test_model_families.py.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# style -> (template, special tokens, eos, bos, end-of-turn token); EOS is not the end-of-turn token
STYLES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|endoftext|>", None, "<|im_end|>"),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|end_of_text|>",
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
}


def chat_tokenizer(style: str):
    """A character-level tokenizer (the built-in model's characters) with the style's special tokens
    and chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from trainers.models.builtin import CHARACTERS

    template, specials, eos, bos, _ = STYLES[style]
    specials = ["<pad>", "<unk>", *specials]
    vocab = {token: index for index, token in enumerate(specials + list(CHARACTERS))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token=eos, bos_token=bos
    )
    tokenizer.chat_template = template
    return tokenizer


def processes_naming(marker: str, also: str = "") -> list[int]:
    """Live processes (not zombies) whose command line names ``marker`` (and ``also``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if marker in command and also in command and state != "Z" and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def gone_within(marker: str, timeout: float) -> list[int]:
    """The processes naming ``marker`` still alive after waiting up to ``timeout`` seconds for none."""
    deadline = time.monotonic() + timeout
    while (left := processes_naming(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def launched_pids(marker: str) -> list[int]:
    """A launch's launcher and ranks: live processes that run ``tasks.launched_rank`` and name ``marker``."""
    return processes_naming(marker, "tasks.launched_rank")


def wait_until_gone(pids: list[int], marker: str, timeout: float = 90) -> list[int]:
    """The launched processes among ``pids`` still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in launched_pids(marker) if pid in pids]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def scheduler_address(scheduler_file: Path, scheduler: subprocess.Popen, timeout: float = 120) -> str:
    """The address a `dask scheduler` wrote to its ``--scheduler-file`` once it listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (OSError, ValueError, KeyError):  # not written yet, or not flushed
            assert scheduler.poll() is None, f"the dask scheduler exited with {scheduler.returncode}"
            assert time.monotonic() < deadline, f"no dask scheduler address after {timeout} s"
            time.sleep(0.1)


@contextmanager
def dask_cluster(env: dict[str, str], workers: list[list[str]]) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """`dask scheduler` and one `dask worker` per entry of ``workers`` (its extra arguments) on
    loopback, each in its own process group (a worker's nanny starts the worker process in it);
    every group is stopped afterwards, all its processes. The scheduler binds a port of its own and
    says which in its scheduler file: a port chosen for it beforehand could be taken by another
    test's server first, whose listener the client then waits on (a CI's Client timed out so)."""
    from distributed import Client

    from infra.core.launching import stop_group

    dask = str(Path(sys.executable).parent / "dask")
    processes = []

    with tempfile.TemporaryDirectory(prefix="alignflow-dask-") as folder:
        cluster_env = env | {"TMPDIR": folder}  # the scheduler's and workers' dask-scratch-space, not /tmp's

        def start(command: list[str]) -> subprocess.Popen:
            processes.append(
                subprocess.Popen(command, env=cluster_env, start_new_session=True, stderr=subprocess.DEVNULL)
            )
            return processes[-1]

        scheduler_file = Path(folder) / "scheduler.json"
        try:
            scheduler = start(
                [dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0",
                 "--scheduler-file", str(scheduler_file)]
            )  # fmt: skip
            address = scheduler_address(scheduler_file, scheduler)
            for extra in workers:
                start([dask, "worker", address, "--nthreads", "1", "--no-dashboard", *extra])
            with Client(address, timeout=180) as client:
                client.wait_for_workers(len(workers), timeout=180)
            yield address, processes
        finally:
            for process in reversed(processes):
                stop_group(process, grace=30)  # the whole group: a nanny's worker process can outlive the nanny


def flow_run_logs(flow_run_id) -> list[str]:
    """The messages the flow run logged to the Prefect API (this process's queued ones sent first)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def cancelled_run_state(flow_run_id, timeout: float = 120):
    """The flow run's final state once it reached one (cancelled or crashed) after a cancel."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while (final := client.read_flow_run(flow_run_id).state).type not in (StateType.CANCELLED, StateType.CRASHED):
            assert time.monotonic() < deadline, f"the flow run is still {final.type}"
            time.sleep(1)
    return final


def launch_worker(module: str, spec: dict, processes: int, folder: Path) -> list[dict]:
    """The worker module ``module`` of tests/ under ``accelerate launch`` with ``processes`` CPU
    processes (gloo), given ``spec`` and ``output_dir`` (``folder``) as its spec file's JSON; every
    rank's results, which rank 0 writes to ``result.json`` there, after checking the world size."""
    from infra.core.config import ComputeConfig, launcher_temp_folder
    from infra.core.ports import free_port

    folder.mkdir(parents=True)
    spec_file = folder / "spec.json"
    spec_file.write_text(json.dumps(spec | {"output_dir": str(folder)}))
    command = ComputeConfig(cpu=True, num_processes=processes, main_process_port=free_port()).launch_command(
        spec_file, module=module
    )
    path = os.pathsep.join([str(PROJECT), str(PROJECT / "tests")])
    # the launcher's temp folder is this test's, not the one the launched stage tests check for
    # leftovers while they run on the other worker
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        **launcher_temp_folder(folder / "tmp"),
    }
    done = subprocess.run(
        command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((folder / "result.json").read_text())
    assert [r["world_size"] for r in results] == [processes] * processes
    return results


# A multiple-choice task over the built-in task's problems: every model, trained or not, gets a
# log-likelihood of each choice, so two fresh models score apart and the comparison is of the harness's numbers.
CHOICE_TASK = """task: addition_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def choice_task(folder: Path) -> Path:
    """The task YAML and its local data (30 problems, the right answer among three)."""
    from trainers.data.synthetic import AdditionTask, generate_addition

    rows = generate_addition(AdditionTask(max_operand=9, num_eval_problems=30))["eval_prompts"]
    data = folder / "choice.jsonl"
    with data.open("w") as out:
        for index, row in enumerate(rows):
            answer = int(row["answer"])
            choices = [str(answer + offset) for offset in (-1, 0, 1)]
            label = index % 3  # the right answer in every place
            choices[label], choices[1] = choices[1], choices[label]
            out.write(json.dumps({"prompt": row["prompt"], "choices": choices, "label": label}) + "\n")
    task = folder / "addition_choice.yaml"
    task.write_text(CHOICE_TASK.format(data=data))
    return task


def assert_suites_as_one_process(two: list, one: list) -> None:
    """Suite scores of two processes (``ModelScores`` per model) are one process's: the same per-document
    values; a standard error sums them in another order (the first process's, then the second's), so
    it may differ in its last bit. Of :func:`choice_task` (30 documents) and 7 addition prompts."""
    assert [s.per_prompt for s in two] == [s.per_prompt for s in one]
    for two_scores, one_scores in zip(two, one):
        assert two_scores.metrics.keys() == one_scores.metrics.keys()
        for name, value in one_scores.metrics.items():
            assert two_scores.metrics[name] == (pytest.approx(value, rel=1e-12) if "_stderr/" in name else value), name
    assert len(one[0].per_prompt["addition_choice/acc/none"]) == 30
    assert len(one[0].per_prompt["addition/exact_match/none"]) == 7
