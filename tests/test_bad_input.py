"""Bad input fails at load time, through the CLI, with one message that names the file, key or
position, exit code 2, and nothing left behind in the state folder (no cache entry, no staging
folder, no output, no MLflow run). Also: the security rules of issue 11 (reward import paths,
safe names, redacted credentials, a 0700 state folder) and the short error output."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from infra.core.config import load_config
from infra.core.processes import listening_pids, pid_alive
from infra.core.settings import Settings, StateFolderError, configure_environment, prepare_state_folder, redact_url
from infra.ops import cli

MINIMAL = "configs/minimal.yaml"

BAD_REWARDS = """
def no_columns(prompts, completions):
    return [0.0 for _ in completions]


def good(prompts, completions, **columns):
    return [1.0 for _ in completions]


NOT_CALLABLE = 3
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Bad files of every kind, and an allowed plugin module of rewards with wrong signatures."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "alignflow_bad_rewards.py").write_text(BAD_REWARDS)
    (tmp_path / "broken.yaml").write_text("name: x\ndpo: {beta: 0.2\nsft: 1\n")
    (tmp_path / "tab.yaml").write_text("name: x\n\tdpo: 1\n")
    (tmp_path / "list.yaml").write_text("- name\n- stages\n")
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (tmp_path / "weights.safetensors").write_bytes(b"\0")
    (tmp_path / "twice.yaml").write_text("name: x\ndpo: {beta: 0.2}\ndpo: {beta: 0.3}\n")
    (tmp_path / "merge.yaml").write_text("shared: &shared\n  beta: 0.2\ndpo:\n  <<: *shared\n")
    (tmp_path / "complex-key.yaml").write_text("name: x\n? [1, 2]\n: 3\n")
    bomb = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    bomb += [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcde", "bcdef")]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    (tmp_path / "deep.yaml").write_text("name: " + "[" * 100 + "]" * 100 + "\n")
    os.mkfifo(tmp_path / "fifo.yaml")  # reading it would block until a writer came
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "outside.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text('{"model_type": "mamba9000", "architectures": ["Mamba9000"]}')
    yield tmp_path
    sys.modules.pop("alignflow_bad_rewards", None)


# case: (argv after `alignflow`, what the error line must name); {tmp} is the `files` folder.
CASES = {
    "malformed-yaml-file": (["run", "{tmp}/broken.yaml"], "{tmp}/broken.yaml: line 3, column 4:"),
    "yaml-tab": (["run", "{tmp}/tab.yaml"], "{tmp}/tab.yaml: line 2, column 1:"),
    "yaml-not-a-mapping": (["run", "{tmp}/list.yaml"], "{tmp}/list.yaml: the file must hold a mapping"),
    "yaml-key-twice": (["run", "{tmp}/twice.yaml"], "{tmp}/twice.yaml: line 3, column 1: key 'dpo' is given twice"),
    "yaml-merge-key": (
        ["run", "{tmp}/merge.yaml"],
        "alignflow: invalid config: {tmp}/merge.yaml: line 4, column 3: merge keys (<<) are not supported: write "
        "the keys out\n",
    ),
    "yaml-complex-key": (
        ["run", "{tmp}/complex-key.yaml"],
        "alignflow: invalid config: {tmp}/complex-key.yaml: line 2, column 3: a key must be a plain value, not a "
        "list\n",
    ),
    "override-complex-key": (
        ["run", MINIMAL, "dpo={? {a: 1}: 2}"],
        "override 'dpo={? {a: 1}: 2}': line 1, column 4: a key must be a plain value, not a mapping",
    ),
    "yaml-alias-bomb": (["run", "{tmp}/bomb.yaml"], "{tmp}/bomb.yaml: more than 100,000 values once its aliases"),
    "yaml-nested-deep": (["run", "{tmp}/deep.yaml"], "{tmp}/deep.yaml: line 1, column 70: nested deeper than 64"),
    "override-nested-deep": (["run", MINIMAL, "name=" + "[" * 100 + "]" * 100], "nested deeper than 64 levels"),
    "config-is-a-fifo": (["run", "{tmp}/fifo.yaml"], "{tmp}/fifo.yaml: not a regular file"),
    "config-is-a-folder": (["run", "{tmp}"], "{tmp}: not a regular file"),
    "float-infinite": (["run", MINIMAL, "dpo.beta=.inf"], "dpo.beta: Input should be a finite number"),
    "plugin-relative": (["run", MINIMAL, "plugins=[.x]"], "plugins: '.x' is not a module name"),
    "chat-template-missing": (
        ["run", MINIMAL, "data.chat_template={tmp}/chatml.jinja"],
        "data.chat_template: no such file '{tmp}/chatml.jinja' (and not a Jinja template",
    ),
    "chat-template-outside-the-project": (
        ["run", MINIMAL, "data.chat_template={tmp}/outside.jinja"],
        "data.chat_template: '{tmp}/outside.jinja' lies outside the folders a template file may come from",
    ),
    "builtin-no-training-problems": (
        ["run", MINIMAL, "data.builtin.num_eval_problems=100"],
        "data.builtin: num_eval_problems=100 leaves no training problems: max_operand=9 gives 100",
    ),
    "data-path-is-a-folder": (
        ["run", MINIMAL, "data.sft={path: {tmp}/folder.jsonl}"],
        "data.sft.path: data file '{tmp}/folder.jsonl' is not a regular file",
    ),
    "yaml-not-utf8": (["run", "{tmp}/latin1.yaml"], "{tmp}/latin1.yaml: not UTF-8 text"),
    "missing-config-file": (["run", "{tmp}/nope.yaml"], "{tmp}/nope.yaml: no such file"),
    "malformed-override": (["run", MINIMAL, "dpo.beta=[0.1"], "override 'dpo.beta=[0.1': line 1, column"),
    "override-without-value": (["run", MINIMAL, "dpo.beta"], "override 'dpo.beta' is not of the form key.sub=value"),
    "unknown-key": (["run", MINIMAL, "dpo.bta=0.1"], "unknown key dpo.bta: did you mean dpo.beta?"),
    "bad-value": (["run", MINIMAL, "dpo.beta=-1"], f"{MINIMAL}: dpo.beta: Input should be greater than 0"),
    "promotion-metric": (
        ["run", MINIMAL, "promotion.metric=accuracy"],
        "promotion.metric: 'accuracy' is not a metric the evaluation produces; known: greedy_accuracy",
    ),
    "promotion-metric-pass-k-not-sampled": (
        ["run", MINIMAL, "promotion.metric=pass_at_4"],  # minimal.yaml draws 2 samples: pass@4 is skipped
        "promotion.metric: 'pass_at_4' is not a metric",
    ),
    "promotion-metric-without-paired-test": (
        ["run", MINIMAL, "promotion.registered_model=m", "promotion.metric=rewards/accuracies"],
        "promotion.metric: 'rewards/accuracies' has no per-prompt values for the paired test",
    ),
    "pass-k-zero": (["run", MINIMAL, "evaluation.pass_k=[1, 0]"], "evaluation.pass_k.1: Input should be greater"),
    "reward-import-not-in-plugins": (
        ["run", MINIMAL, "grpo.reward_funcs=[this:x]"],
        "grpo: reward function 'this:x': module 'this' is not listed in plugins",
    ),
    "reward-unknown": (["run", MINIMAL, "grpo.reward_funcs=[correctnes]"], "unknown reward function 'correctnes'"),
    "reward-without-columns": (
        ["run", MINIMAL, "plugins=[alignflow_bad_rewards]", "grpo.reward_funcs=[alignflow_bad_rewards:no_columns]"],
        "'alignflow_bad_rewards:no_columns' has the signature (prompts, completions); it must accept",
    ),
    "reward-not-callable": (
        ["run", MINIMAL, "plugins=[alignflow_bad_rewards]", "grpo.reward_funcs=[alignflow_bad_rewards:NOT_CALLABLE]"],
        "'alignflow_bad_rewards:NOT_CALLABLE' is not callable",
    ),
    "plugin-missing": (["run", MINIMAL, "plugins=[no_such_plugin]"], "plugins: cannot import 'no_such_plugin'"),
    "empty-experiment-name": (["run", MINIMAL, "tracking.experiment_name=''"], "tracking.experiment_name:"),
    "blank-experiment-name": (["run", MINIMAL, "tracking.experiment_name='  '"], "tracking.experiment_name:"),
    "empty-name": (["run", MINIMAL, "name=''"], "name: '' is not a safe name"),
    "name-escapes-state-folder": (["run", MINIMAL, "name=../../x"], "name: '../../x' is not a safe name"),
    "name-with-slash": (["run", MINIMAL, "name=a/b"], "name: 'a/b' is not a safe name"),
    "name-hidden": (["run", MINIMAL, "name=.x"], "name: '.x' is not a safe name"),
    "missing-data-file": (
        ["run", MINIMAL, "data.preference.path={tmp}/pairs.jsonl"],
        "data.preference.path: data file '{tmp}/pairs.jsonl' does not exist",
    ),
    "missing-csv-file": (
        ["run", MINIMAL, "data.sft.path={tmp}/sft.csv"],
        "data.sft.path: data file '{tmp}/sft.csv' does not exist",
    ),
    "unknown-builtin-model": (
        ["run", MINIMAL, "model.source=builtin:huge-llama"],
        "model.source: unknown built-in model 'builtin:huge-llama'; known: builtin:tiny-llama",
    ),
    "missing-model-folder": (
        ["run", MINIMAL, "model.source={tmp}/checkpoints/sft"],
        "model.source: model folder '{tmp}/checkpoints/sft' does not exist",
    ),
    "unknown-architecture": (
        ["run", MINIMAL, "model.source={tmp}/foreign"],
        "model.source: model folder {tmp}/foreign: config.json's model_type 'mamba9000' is not an architecture "
        "transformers ",
    ),
    "relative-model-folder": (["run", MINIMAL, "model.source=./no-model"], "model folder './no-model' does not exist"),
    "model-source-is-a-file": (
        ["run", MINIMAL, "model.source={tmp}/weights.safetensors"],
        "model.source: model source '{tmp}/weights.safetensors' is a file",
    ),
    "prompt-longer-than-sequence": (
        ["run", MINIMAL, "data.max_prompt_length=40"],
        "data: max_prompt_length (40) must be less than max_length (32)",
    ),
    "no-stages": (["run", MINIMAL, "stages=[]"], "stages: List should have at least 1 item"),
    "repeated-stage": (["run", MINIMAL, "stages=[sft, sft]"], "stages must not repeat"),
    "unknown-stage": (["run", MINIMAL, "stages=[ppo]"], "stages.0:"),
    "evaluate-unsafe-name": (
        ["evaluate", "configs/evaluate.yaml", "name=../out"],
        "configs/evaluate.yaml: name: '../out' is not a safe name",
    ),
    "evaluate-missing-model": (
        ["evaluate", "configs/evaluate.yaml", "models={a: {tmp}/missing}"],
        "models.a: model folder '{tmp}/missing' does not exist",
    ),
    "evaluate-unsafe-label": (
        ["evaluate", "configs/evaluate.yaml", "models={../x: builtin:tiny-llama}"],
        "models.../x.[key]: '../x' is not a safe name",
    ),
    "evaluate-no-models": (
        ["evaluate", "configs/evaluate.yaml", "models={}"],
        "models: Dictionary should have at least",
    ),
}


def snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "prefect" not in p.parts)


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_at_load_naming_the_place_and_leaves_nothing_behind(case, files, state_dir, capsys):
    argv, expected = CASES[case]
    argv = [arg.replace("{tmp}", str(files)) for arg in argv]
    before = snapshot(state_dir)
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert expected.replace("{tmp}", str(files)) in err
    assert all(line.startswith(("alignflow: ", "unknown key ")) for line in err.splitlines()), err  # no traceback
    assert snapshot(state_dir) == before  # no cache entry, no staging folder, no output, no MLflow store


FAILS_BEFORE_WORK = {
    "run-bad-config": (["run", MINIMAL, "dpo.beta=-1"], 2),
    "evaluate-bad-request": (["evaluate", "configs/evaluate.yaml", "models={}"], 2),
    "sweep-bad-file": (["sweep", "configs/sweep.yaml", "max_concurrent=0"], 2),
    "run-unsupported-tracking-uri": (["run", MINIMAL], 2),
    "servers-up-refused": (["servers", "up", "--auth"], 2),
    "run-unreachable-tracking-server": (["run", MINIMAL], 1),  # its traceback goes to the temp folder
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(FAILS_BEFORE_WORK))
def test_a_command_that_fails_before_its_work_starts_leaves_no_state_folder(case, tmp_path, monkeypatch, capsys):
    """No folder, no `origin` marker: the state folder is opened where a command's work starts.
    (A command that starts work, `servers status` here, opens it.)"""
    from infra.core import mlflow_compat

    argv, code = FAILS_BEFORE_WORK[case]
    home = tmp_path / "new-state"
    monkeypatch.setenv("ALIGNFLOW_HOME", str(home))
    for name in ("ALIGNFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    if case == "run-unsupported-tracking-uri":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://bar")
    if case == "run-unreachable-tracking-server":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    monkeypatch.setattr(mlflow_compat, "installed_version", lambda: "3.16.0")  # `servers up --auth` refuses it
    try:
        assert cli.main(argv) == code
    except SystemExit as stop:
        assert stop.code == code
    assert capsys.readouterr().err.startswith("alignflow")
    assert not home.exists()
    assert cli.main(["servers", "status"]) == 3
    assert (home / "origin").read_text() == f"{home.as_uri()}\n"


@pytest.mark.unit
def test_each_case_is_another_input_of_a_command_that_loads_a_config():
    """No case repeats another's input (a copy that tests nothing new); every case runs `alignflow
    run` or `alignflow evaluate`, the commands that load a config file with overrides."""
    inputs = [tuple(argv) for argv, _ in CASES.values()]
    assert [argv for argv in inputs if inputs.count(argv) > 1] == []
    assert sorted({argv[0] for argv in inputs}) == ["evaluate", "run"]


@pytest.mark.unit
def test_naming_a_reward_by_import_path_imports_nothing_outside_plugins(files):
    sys.modules.pop("this", None)
    with pytest.raises(ValueError, match="module 'this' is not listed in plugins"):
        load_config(MINIMAL, ["grpo.reward_funcs=[this:x]"])
    assert "this" not in sys.modules
    config = load_config(MINIMAL, ["plugins=[alignflow_bad_rewards]", "grpo.reward_funcs=[alignflow_bad_rewards:good]"])
    assert config.grpo.reward_funcs == ["alignflow_bad_rewards:good"]


@pytest.mark.unit
def test_every_metric_the_evaluation_produces_is_a_valid_promotion_metric(tiny):
    from trainers.evaluation.evaluate import GenerationSpec, answer_metrics, score_prompts
    from trainers.scoring.metrics import evaluation_metric_names

    model, tokenizer = tiny
    rows = [{"prompt_ids": tokenizer("1+1=")["input_ids"], "answer": "2"}]
    results = score_prompts(model, tokenizer, rows, GenerationSpec(2, 2, 1.0, 8, 0))
    produced = answer_metrics(results, [1, 2, 4], seed=0, resamples=10)
    assert set(produced) <= set(evaluation_metric_names([1, 2, 4], 2))
    for metric in produced:
        load_config(MINIMAL, [f"promotion.metric={metric}", "evaluation.pass_k=[1, 2, 4]"])


@pytest.mark.unit
def test_the_state_folder_is_created_0700(tmp_path):
    root = tmp_path / "state" / "nested"
    old = os.umask(0o022)
    try:
        configure_environment(Settings(home=root))
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    root.chmod(0o750)  # a folder shared on purpose keeps its mode
    prepare_state_folder(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o750


@pytest.mark.unit
def test_a_read_only_state_folder_fails_at_once_with_the_cause(tmp_path, monkeypatch, capsys):
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o500)
    if os.access(root, os.W_OK):  # root ignores modes: make the probe's write fail as it would

        def refuse(self, data):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(Path, "write_bytes", refuse)
    with pytest.raises(StateFolderError, match=f"state folder {root}: not writable: Permission denied"):
        prepare_state_folder(root)
    monkeypatch.setenv("ALIGNFLOW_HOME", str(root))
    assert cli.main(["run", MINIMAL]) == 2
    assert f"alignflow: state folder {root}: not writable" in capsys.readouterr().err


@pytest.mark.unit
def test_credentials_are_redacted_in_urls():
    assert redact_url("http://alice:s3cret@mlflow:5000/#/x") == "http://alice:***@mlflow:5000/#/x"
    assert redact_url("https://token@host/") == "https://***@host/"
    assert redact_url("sqlite:////a/b.db") == "sqlite:////a/b.db"
    assert redact_url("http://mlflow:5000/#/experiments/1@2") == "http://mlflow:5000/#/experiments/1@2"
    assert redact_url("postgresql://u:p@ss@db:5432/x?sslmode=require") == "postgresql://u:***@db:5432/x?sslmode=require"
    assert redact_url("postgresql+asyncpg://postgres@db/x") == "postgresql+asyncpg://postgres@db/x"  # a role, no secret


@pytest.mark.unit
def test_credentials_in_a_urls_query_and_fragment_are_redacted():
    """Each parameter whose name holds a credential word (settings.SECRET_PARAMETER_WORDS), any case,
    in the query or the fragment, in any text; other parameters and the text around stay."""
    secret_names = ["token", "access_token", "api_key", "apikey", "key", "password", "passwd", "pwd", "secret"]
    secret_names += ["client_secret", "sig", "signature", "X-Amz-Signature", "X-Amz-Credential"]
    secret_names += ["X-Amz-Security-Token", "X-Goog-Signature", "auth", "sessionid", "Authorization"]
    query = "&".join(f"{name}=v{i}" for i, name in enumerate(secret_names))
    expected = "&".join(f"{name}=***" for name in secret_names)
    assert redact_url(f"see (https://h/a?page=2&{query}#x=1&access_token=t&state=s), then") == (
        f"see (https://h/a?page=2&{expected}#x=1&access_token=***&state=s), then"
    )
    assert redact_url("'http://u:pw@h:1/?Token=abc.def-_~%2F' and http://h/?q=token") == (
        "'http://u:***@h:1/?Token=***' and http://h/?q=token"
    )
    assert redact_url("http://h/#/experiments/1/runs/a?workflowType=machine_learning") == (
        "http://h/#/experiments/1/runs/a?workflowType=machine_learning"
    )


@pytest.mark.unit
def test_mlflow_links_stored_in_prefect_carry_no_password(monkeypatch):
    from tasks.mlflow_runs import mlflow_run_url

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:s3cret@mlflow:5000")
    monkeypatch.delenv("ALIGNFLOW_TRACKING_URI", raising=False)
    assert mlflow_run_url("1", "abc") == (
        "http://alice:***@mlflow:5000/#/experiments/1/runs/abc?workflowType=machine_learning"
    )
    monkeypatch.setenv("ALIGNFLOW_MLFLOW_UI_URL", "https://bob:pw@ui.example")
    assert "pw" not in mlflow_run_url("1", "abc")


@pytest.mark.unit
@pytest.mark.parametrize("variable", ["ALIGNFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI"])
def test_a_tracking_uris_credentials_move_to_mlflows_own_variables(variable, tmp_path, monkeypatch):
    """MLflow names the tracking URI in every failed request's error, which Prefect stores: the URI
    keeps no password; MLflow sends the credentials from its own variables (those set win)."""
    names = ["ALIGNFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    for name in [*names, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "https://alice:s3%2Fcret@mlflow:5000/prefix")
    settings = configure_environment(Settings(home=tmp_path))
    assert settings.mlflow_tracking_uri == "https://mlflow:5000/prefix"
    expected_uris = {variable: "https://mlflow:5000/prefix", "MLFLOW_TRACKING_URI": "https://mlflow:5000/prefix"}
    assert {name: os.environ.get(name) for name in names} == {
        "ALIGNFLOW_TRACKING_URI": None,
        **expected_uris,
        "MLFLOW_TRACKING_USERNAME": "alice",
        "MLFLOW_TRACKING_PASSWORD": "s3/cret",
    }
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ  # nothing left to hide
    monkeypatch.setenv(variable, "http://bob:other@mlflow:5000")
    configure_environment(Settings(home=tmp_path))
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("alice", "s3/cret")


@pytest.mark.unit
def test_a_failing_command_prints_one_line_and_where_the_traceback_is(monkeypatch, state_dir, capsys):
    def broken(args):
        raise RuntimeError("the disk is full\nsecond line")

    monkeypatch.setitem(cli.COMMANDS, "compare", broken)
    assert cli.main(["compare"]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert first == "alignflow: RuntimeError: the disk is full"
    log = Path(second.removeprefix("full traceback: ").removesuffix(" (or run with --debug)"))
    assert log.parent == state_dir / "logs" and "Traceback (most recent call last)" in log.read_text()

    assert cli.main(["--debug", "compare"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.unit
def test_ctrl_c_ends_with_one_line_and_exit_130(monkeypatch, state_dir, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "compare", interrupted)
    assert cli.main(["compare"]) == 130
    first, second = capsys.readouterr().err.splitlines()
    assert first == "alignflow: interrupted (Ctrl-C); runs it left RUNNING are marked FAILED by the next run"
    assert second.startswith(f"full traceback: {state_dir / 'logs'}/")


@pytest.mark.unit
def test_a_traceback_outside_the_state_folder_is_its_owners_only_and_carries_no_password(monkeypatch, tmp_path):
    unusable = tmp_path / "a-file"
    unusable.write_text("")
    monkeypatch.setenv("ALIGNFLOW_HOME", str(unusable))  # logs/ cannot be made below a file: the temp folder
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cli.tempfile, "tempdir", None)
    try:
        raise RuntimeError("API request to http://probeuser:s3cret@127.0.0.1:1/api failed")
    except RuntimeError as error:
        path = cli.write_traceback(error)
    assert path.parent == tmp_path and path.stat().st_mode & 0o777 == 0o600
    assert "probeuser:***@127.0.0.1" in path.read_text() and "s3cret" not in path.read_text()


@pytest.mark.unit
def test_an_experiment_name_never_puts_artifacts_outside_the_state_folder(state_dir):
    from tasks.mlflow_runs import client, experiment_id

    experiment = client().get_experiment(experiment_id("../../outside me"))
    assert experiment.name == "../../outside me"
    assert experiment.artifact_location == f"{state_dir.as_uri()}/mlartifacts/______outside_me"


@pytest.mark.unit
def test_local_model_folders_are_checked_at_resolve_naming_folder_and_file(tiny, tmp_path):
    from infra.core.config import ModelConfig
    from tasks.models import resolve_model

    model, tokenizer = tiny
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    with pytest.raises(ValueError, match=f"model folder {folder}: no tokenizer"):
        resolve_model.fn(ModelConfig(source=str(folder)))
    tokenizer.save_pretrained(folder)
    assert resolve_model.fn(ModelConfig(source=str(folder))).path == str(folder)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=f"model folder {folder}: model.safetensors is corrupt"):
        resolve_model.fn(ModelConfig(source=str(folder)))
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=f"model folder {folder}: config.json is missing"):
        resolve_model.fn(ModelConfig(source=str(folder)))


@pytest.mark.unit
def test_servers_up_refuses_a_port_another_process_listens_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert cli.main(["servers", "up", "prefect", "--prefect-port", str(port), "--timeout", "5"]) == 1
    captured = capsys.readouterr()
    assert f"alignflow: prefect: port {port} on 127.0.0.1 is not free" in captured.err
    assert "prefect: stopped" in captured.out and "healthy" not in captured.out
    assert not (tmp_path / "servers" / "prefect" / "pid").exists()  # nothing was started


@pytest.mark.unit
def test_servers_authenticate_unless_told_not_to_and_not_both():
    parser = cli.build_parser()
    assert [parser.parse_args(["servers", "up", *flags]).auth for flags in ([], ["--auth"], ["--no-auth"])] == [
        True,
        True,
        False,
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["servers", "up", "--auth", "--no-auth"])


@pytest.mark.slow
def test_servers_report_a_dead_server_even_if_its_port_answers(tmp_path, monkeypatch):
    """Its own server failed ("address already in use") while another process answers the health URL."""
    from infra.ops import servers

    spec = servers.ServerSpec("dies", "", "http://127.0.0.1:9/none", ["sh", "-c", "echo in use; exit 1"], {}, {}, "")
    pid = servers.start(spec, tmp_path)
    while pid_alive(pid):
        time.sleep(0.05)
    monkeypatch.setattr(servers, "is_healthy", lambda url: True)  # the other process answers
    assert servers.wait_healthy({"dies": spec}, {"dies": tmp_path}, timeout=30) == ["dies"]
    assert "in use" in servers.log_tail(tmp_path)


@pytest.mark.slow
def test_servers_up_does_not_take_another_process_answer_for_its_own_server(tmp_path, monkeypatch):
    """Its own server runs (not yet listening) while another process listens and answers on its port."""
    from infra.ops import servers

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        url = f"http://127.0.0.1:{other.getsockname()[1]}/health"
        spec = servers.ServerSpec("ours", "", url, ["sh", "-c", "sleep 60"], {}, {}, "")
        servers.start(spec, tmp_path)
        try:
            monkeypatch.setattr(servers, "is_healthy", lambda url: True)  # the other process answers
            if listening_pids(other.getsockname()[1]) is None:
                pytest.skip("no /proc to tell who listens")
            assert servers.wait_healthy({"ours": spec}, {"ours": tmp_path}, timeout=30) == ["ours"]
        finally:
            servers.stop(tmp_path, timeout=5)


@pytest.mark.unit
def test_log_records_with_credentials_are_redacted_and_lose_their_traceback_on_the_terminal():
    record = logging.LogRecord("prefect", logging.ERROR, __file__, 1, "View at %s", ("http://u:pw@ui/runs/1",), None)
    assert cli.RedactUrls().filter(record) and record.getMessage() == "View at http://u:***@ui/runs/1"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord("prefect", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert cli.ShortTracebacks().filter(failed) and failed.exc_info is None


@pytest.mark.unit
def test_an_unreachable_tracking_server_fails_at_once_naming_it_and_creates_nothing(monkeypatch, state_dir, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:s3cret@127.0.0.1:1")
    for name in ("ALIGNFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: the CLI sets the last two
    before = [path for path in snapshot(state_dir) if not path.startswith("logs")]
    assert cli.main(["run", MINIMAL]) == 1
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("alignflow: TrackingServerUnreachable: the MLflow tracking server ")
    assert "http://127.0.0.1:1 does not answer (" in first  # its credentials went to MLflow's own variables
    assert "refused" in first and "s3cret" not in first
    assert [path for path in snapshot(state_dir) if not path.startswith("logs")] == before  # no run, no store


@pytest.mark.unit
@pytest.mark.parametrize("variable", ["MLFLOW_TRACKING_URI", "ALIGNFLOW_TRACKING_URI"])
def test_an_unsupported_tracking_uri_is_refused_before_anything_starts_naming_the_variable(
    variable, monkeypatch, state_dir, capsys
):
    for name in ("ALIGNFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "foo://bar?token=secret")
    before = snapshot(state_dir)
    started = time.monotonic()
    assert cli.main(["run", MINIMAL]) == 2
    assert time.monotonic() - started < 5  # no flow run, no Prefect server, no MLflow
    assert capsys.readouterr().err == (
        f"alignflow: {variable}=foo://bar?token=***: MLflow has no tracking store for the scheme 'foo'; use one "
        "of databricks://, file://, http://, https://, mssql://, mysql://, postgresql://, sqlite:// or a local path\n"
    )
    assert snapshot(state_dir) == before


@pytest.mark.unit
def test_the_tracking_uris_mlflow_takes_are_not_refused():
    from infra.core.reachability import unsupported_tracking_uri

    taken = ["sqlite:////a/b.db", "postgresql+psycopg2://u@db/x", "mysql://db/x", "https://mlflow", "databricks"]
    taken += ["/a/mlruns", "file:///a/mlruns", "databricks://profile"]
    assert [unsupported_tracking_uri(Settings(tracking_uri=uri)) for uri in taken] == [None] * len(taken)
    assert unsupported_tracking_uri(Settings(tracking_uri="s3://bucket/x")).startswith(
        "ALIGNFLOW_TRACKING_URI=s3://bucket/x: MLflow has no tracking store for the scheme 's3'"
    )


@pytest.mark.unit
def test_a_full_disk_is_said_with_the_space_left(state_dir, capsys):
    error = RuntimeError("train-sft failed")
    error.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "outputs/minimal/sft-x/model.safetensors")
    cli.report_error(f"run lucky-fox: {error}", error)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "alignflow: run lucky-fox: train-sft failed"
    assert lines[1].startswith("alignflow: the disk ran out of space (")
    assert f"MiB free where {state_dir} is); free some" in lines[1]
    assert lines[2].startswith("full traceback: ")
    assert cli.out_of_space(None, "run x: OperationalError: (sqlite3.OperationalError) database or disk is full")
    assert not cli.out_of_space(ValueError("bad row"), "run x: ValueError: bad row")
