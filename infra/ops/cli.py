"""``alignflow`` command line."""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from functools import partial
from pathlib import Path

from infra.core.reachability import UnsupportedTrackingUri, require_tracking_server
from infra.core.settings import StateFolderError, configure_environment, get_settings, open_state_folder, redact_url
from infra.ops import service_cli
from infra.ops.cache_cli import add_cache_parser, cache_command
from infra.ops.databases import first_time_setup, prepare_databases
from infra.ops.gc_cli import add_gc_parser, gc_command
from infra.ops.runs import add_runs_parser, cleanup, runs_command
from trainers.runtime.fast_exit import end_at_exit_without_teardown


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignflow", description="Preference and RL training pipelines on Prefect, tracked in MLflow."
    )
    parser.add_argument("--version", action="version", version=f"alignflow {importlib.metadata.version('alignflow')}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print full tracebacks (by default: one error line, traceback in a log file)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run the experiment flow",
        description=(
            "Run prepare → the configured stages (SFT → reference "
            "log-probs → DPO → GRPO by default) → evaluate for a config."
        ),
        epilog="example: alignflow run configs/default.yaml dpo.beta=0.2 sft.num_train_epochs=10",
    )
    run.add_argument("config", nargs="?", help="experiment YAML (default: the built-in defaults)")
    run.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="override config fields (values parsed as YAML)"
    )
    run.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")

    evaluate = commands.add_parser(
        "evaluate",
        help="score models on an eval spec",
        description="Score any models (local path, runs:/…, models:/name@alias, hub id) on the same prompts and seeds.",
        epilog="example: alignflow evaluate configs/evaluate.yaml 'models={dpo: models:/alignflow-addition@champion}'",
    )
    evaluate.add_argument("config", help="evaluation request YAML (see configs/evaluate.yaml)")
    evaluate.add_argument("overrides", nargs="*", metavar="key.sub=value")
    evaluate.add_argument("--print-config", action="store_true", help="print the resolved request as YAML and exit")

    sweep = commands.add_parser(
        "sweep",
        help="run a sweep: many experiments on a Dask cluster",
        description="Run the trials of a sweep file (base config, search space, strategy, objective) on a Dask "
        "cluster; each trial is an experiment flow run nested under the sweep's MLflow run.",
        epilog="example: alignflow sweep configs/sweep.yaml max_concurrent=1 base.sft.max_steps=4 "
        "'space.dpo.beta=[0.1, 0.5]'",
    )
    sweep.add_argument("config", help="sweep YAML (see configs/sweep.yaml)")
    sweep.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="override sweep fields; base.<key> for the experiment"
    )
    sweep.add_argument("--print-config", action="store_true", help="print the resolved sweep as YAML and exit")
    sweep.add_argument("--plan", action="store_true", help="validate and print the planned trials; run nothing")

    compare = commands.add_parser(
        "compare",
        help="compare an experiment's runs",
        description=(
            "Table of runs x key params x final eval metrics with deltas, training-curve and eval-metric plots."
        ),
    )
    compare.add_argument("--experiment", default="alignflow", help="MLflow experiment (default: alignflow)")
    compare.add_argument("--baseline", help="run id, run name or key=value tag (default: the oldest run)")
    compare.add_argument("--metric", action="append", dest="metrics", help="final eval metric to compare (repeatable)")
    compare.add_argument("--curve", action="append", dest="curves", help="training metric to plot (repeatable)")
    compare.add_argument("--filter", help="MLflow search filter, e.g. \"params.`dpo.beta` = '0.5'\"")
    compare.add_argument("--runs", nargs="+", help="run ids or run names to compare")
    compare.add_argument("--last", type=int, help="only the last N runs (by start time)")
    compare.add_argument(
        "--stage", help="stage whose training curves are plotted (default: the first whose settings differ)"
    )
    add_cache_parser(commands)
    add_gc_parser(commands)
    add_runs_parser(commands)
    service_cli.add_parsers(commands)
    return parser


DEBUG = False  # --debug: tracebacks on the terminal too
STANDALONE = False  # this process is the `alignflow` command (cli()), not a caller of main()
EXIT_CODE = 0


def write_traceback(error: BaseException) -> Path | None:
    """The full traceback of ``error`` in a log file under the state folder (the temp folder if that
    is unusable, or not opened yet: a command that failed before its work started makes none);
    None when neither can be written (a full disk)."""
    text = redact_url("".join(traceback.format_exception(error)))
    name = f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        root = get_settings().root
        if not root.is_dir():
            raise FileNotFoundError(root)
        folder = root / "logs"
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / name).write_text(text)
        return folder / name
    except OSError:
        path = Path(tempfile.gettempdir()) / f"alignflow-{name}"
        try:  # outside the 0700 state folder: readable by its owner only
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
                handle.write(text)
        except OSError:
            return None
        return path


# What a full disk says: the OS (ENOSPC), and SQLite (the MLflow and Prefect stores) in its own words.
OUT_OF_SPACE = (os.strerror(errno.ENOSPC), "database or disk is full")


def out_of_space(error: BaseException | None, message: str = "") -> bool:
    """Whether ``error``, an error it was raised from or during, or ``message`` says the disk is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        message += f"\n{error}"
        error = error.__cause__ or error.__context__
    return any(words in message for words in OUT_OF_SPACE)


def report_error(message: str, error: BaseException | None = None) -> None:
    """One line ``alignflow: <message>``, then where the full traceback is (or, with --debug, the
    traceback); for a full disk, a line that says so, with the space left in the state folder."""
    first = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    print(f"alignflow: {redact_url(first)}", file=sys.stderr)
    if out_of_space(error, message):
        root = get_settings().root
        free = shutil.disk_usage(root).free / 2**20 if root.exists() else 0.0
        print(
            f"alignflow: the disk ran out of space ({free:.0f} MiB free where {root} is); free some (alignflow gc, "
            "alignflow cache gc) and run again: runs this one could not mark FAILED are marked then",
            file=sys.stderr,
        )
    if error is not None:
        if DEBUG:
            print(redact_url("".join(traceback.format_exception(error))), file=sys.stderr, end="")
        elif (path := write_traceback(error)) is not None:
            print(f"full traceback: {path} (or run with --debug)", file=sys.stderr)
        else:
            print("full traceback: not written (no space left); run with --debug to see it", file=sys.stderr)


def finished(state) -> int:
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        if isinstance(error, BaseException):
            report_error(f"run {state.name}: {type(error).__name__}: {error}", error)
        else:
            report_error(f"run {state.name}: {state.message}")
        return 1
    return 0


class ShortTracebacks(logging.Filter):
    """On the terminal, Prefect's failure records keep their message and lose their traceback (it
    goes to the log file named by :func:`report_error`); --debug keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not DEBUG:
            record.exc_info, record.exc_text = None, None
            record.msg = str(record.msg).split("\nTraceback (most recent call last)")[0]
        return True


class RedactUrls(logging.Filter):
    """Credentials in URLs of a log record (e.g. Prefect's "View at <UI URL>") become ``***``, on the
    terminal and in the logs Prefect stores."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (redacted := redact_url(message)) != message:
            record.msg, record.args = redacted, ()
        return True


def quiet_prefect_tracebacks() -> None:
    """Filters on the handlers logging has now (Prefect's, set up when it is imported)."""
    for logger in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
        for handler in getattr(logger, "handlers", []):
            kinds = {type(f) for f in handler.filters}
            if RedactUrls not in kinds:
                handler.addFilter(RedactUrls())
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                if ShortTracebacks not in kinds:
                    handler.addFilter(ShortTracebacks())


def load_or_exit(schema, args: argparse.Namespace, reader=None):
    """The validated config, or exit 2 with the error (and near matches for unknown keys); with
    ``--print-config``, print the resolved config as YAML and exit 0."""
    import yaml
    from pydantic import ValidationError

    from infra.core.config import config_errors, did_you_mean, load_config, read_yaml

    try:
        config = load_config(args.config, args.overrides, schema, reader or read_yaml)
    except ValidationError as error:
        where = f"{args.config}: " if args.config else ""
        for key, message in config_errors(error):
            print(f"alignflow: invalid config: {where}{key + ': ' if key else ''}{message}", file=sys.stderr)
        for hint in did_you_mean(error, schema):
            print(hint, file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, FileNotFoundError) as error:
        print(f"alignflow: invalid config: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        raise SystemExit(0)
    return config


def check_compute_or_exit(config, args: argparse.Namespace) -> None:
    """Exit 2 when this machine cannot run ``config.compute`` (device count, bfloat16, machine rank):
    before the flow starts. This looks at the
    hardware, so it imports torch."""
    from infra.core.config import ComputeError, check_compute

    try:
        check_compute(config.compute)
    except ComputeError as error:
        print(f"alignflow: invalid config: {config_place(args)}{error}", file=sys.stderr)
        raise SystemExit(2) from None


def check_model_or_exit(source: str, args: argparse.Namespace) -> None:
    """Exit 2 when the model ``source`` is a local folder that cannot be loaded (its files, an
    architecture transformers does not know): before the flow starts. Imports transformers."""
    from infra.core.config.schema import is_model_folder

    if not is_model_folder(source):
        return
    from tasks.models import check_model_folder

    try:
        check_model_folder(Path(source).expanduser())
    except ValueError as error:
        print(f"alignflow: invalid config: {config_place(args)}model.source: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def config_place(args: argparse.Namespace) -> str:
    return f"{args.config}: " if args.config else ""


def clean_up_dead_runs() -> None:
    """Before a run: runs of this host left RUNNING by a process that is gone are marked failed
    (``alignflow runs cleanup``); a problem there is a warning, not a reason to not run."""
    try:
        cleanup(say=lambda line: print(f"alignflow: {line}", file=sys.stderr), quiet=True)
    except Exception as error:
        cause = redact_url(f"{type(error).__name__}: {error}")
        print(f"alignflow: warning: runs cleanup failed ({cause})", file=sys.stderr)


def import_quietly(module: str) -> None:
    """Import ``module`` ahead of the task that needs it; a failure is that task's to report."""
    try:
        importlib.import_module(module)
    except Exception:
        pass


def run_flow(module: str, name: str, *args, check=None, before_run=None, preload=(), outcome=finished, **kwargs) -> int:
    """Import and run a flow (``check()`` first, ``before_run()`` just before the flow starts); the
    exit code is ``outcome`` of its final state (:func:`finished`: 0 when it completed, else 1). As the
    ``alignflow`` process (not when :func:`main` is called in-process), the Prefect API is chosen
    before the import, so that a temporary server boots meanwhile (:mod:`infra.ops.prefect_api`;
    on a fresh state folder under the first-time set-up lock), and the process ends without
    interpreter teardown (:mod:`trainers.runtime.fast_exit`). The flows import torch only where a task
    computes. While the process waits for the temporary server, it imports the modules ``preload``
    one at a time, for as long as the server is not up: all of them on a fresh state folder (the
    server migrates a new database), else only the first (torch), which about fills the wait on
    this 2-core machine; a run that finds everything cached then imports nothing else."""
    from infra.ops.prefect_api import configured_prefect_api, start_temporary_server

    require_tracking_server()
    if not STANDALONE:
        if check is not None:
            check()
        open_state_folder()
        prepare_databases()
        flow = getattr(importlib.import_module(module), name)
    else:
        end_at_exit_without_teardown(lambda: EXIT_CODE)  # first registered: runs after every other exit hook
        open_state_folder()  # the work starts: the temporary server logs and keeps its database in it
        api = configured_prefect_api()
        with first_time_setup(temporary_prefect=api is None) as setup:
            if api is not None:
                os.environ.update(api)
            temporary_server = start_temporary_server() if api is None else None
            if check is not None:
                check()  # it may import torch: after the server's launch, which then boots meanwhile
            flow = getattr(importlib.import_module(module), name)
            setup.create_mlflow_store()  # on a fresh folder: while the server still migrates its database
            if temporary_server is not None:
                # a new database migrates for seconds after the imports; otherwise the start leaves about torch's import
                steps = preload if setup.first_time else preload[:1]
                temporary_server.wait_ready(meanwhile=[partial(import_quietly, module) for module in steps])
    quiet_prefect_tracebacks()
    if before_run is not None:
        before_run()
    return outcome(flow(*args, **kwargs, return_state=True))


# What a run that computes imports, in steps of about a second (torch, transformers' models, the
# trainers), while the temporary server starts (:func:`run_flow`).
EVALUATION_MODULES = ("torch", "trainers.models.pretrained", "trainers.evaluation.evaluate")
TRAINING_MODULES = (*EVALUATION_MODULES, "tasks.stage_trainer")


# The config is validated before anything heavy is imported (torch, Prefect, the flows), so a bad
# file fails at once; flows are imported after configure_environment: Prefect reads it at import.
def run_command(args: argparse.Namespace) -> int:
    from infra.core.config import ExperimentConfig

    config = load_or_exit(ExperimentConfig, args)

    def check() -> None:
        check_compute_or_exit(config, args)
        check_model_or_exit(config.model.source, args)

    return run_flow(
        "flows.pipeline", "experiment", config, check=check, before_run=clean_up_dead_runs, preload=TRAINING_MODULES
    )


def evaluate_command(args: argparse.Namespace) -> int:
    from infra.core.config import EvaluationRequest

    request = load_or_exit(EvaluationRequest, args)
    check = lambda: check_compute_or_exit(request, args)
    return run_flow("flows.evaluation", "evaluation", request, check=check, preload=EVALUATION_MODULES)


def sweep_command(args: argparse.Namespace) -> int:
    """Exit 2 when a trial's config is invalid (nothing ran), 1 when the sweep or any trial failed."""
    from infra.core.sweep import SweepConfig, read_sweep_tree

    spec = load_or_exit(SweepConfig, args, read_sweep_tree)
    from tasks.search import plan, sweep_errors

    _, trials = plan(spec)
    if errors := sweep_errors(spec, trials):
        for error in errors:
            print(f"alignflow: invalid sweep: {args.config}: {error}", file=sys.stderr)
        return 2
    if args.plan:
        for trial in trials:
            print(f"trial {trial.number}: {trial.label}")
        print(f"{spec.trial_count} trials, {spec.strategy}" + (" (asked as results come in)" if not trials else ""))
        return 0
    from infra.ops.prefect_api import shared_prefect_api

    # The trials' Dask workers use this process's Prefect API: the command's own (run_flow), or,
    # when main() is called in-process, one shared for the block (in the state folder).
    if not STANDALONE:
        open_state_folder()
    with nullcontext() if STANDALONE else shared_prefect_api():
        return run_flow("flows.sweep", "sweep", spec, outcome=sweep_outcome)


def sweep_outcome(state) -> int:
    """0 when every trial completed; 1, naming each failed trial, when one did not or the sweep failed."""
    if code := finished(state):
        return code
    failed = [t for t in state.result().trials if t.status != "completed"]
    for trial in failed:
        report_error(f"trial {trial.number} ({trial.status}): {trial.error}")
    return 1 if failed else 0


def compare_command(args: argparse.Namespace) -> int:
    chosen = {"metrics": args.metrics, "curves": args.curves, "stage": args.stage}
    chosen |= {"filter": args.filter, "runs": args.runs, "last": args.last}
    options = {k: v for k, v in chosen.items() if v}
    return run_flow("flows.compare", "compare", experiment=args.experiment, baseline=args.baseline, **options)


COMMANDS = {
    "run": run_command,
    "evaluate": evaluate_command,
    "compare": compare_command,
    "sweep": sweep_command,
    "cache": cache_command,
    "gc": gc_command,
    "runs": runs_command,
    **service_cli.COMMANDS,
}


# Commands that check their input first and open the state folder once their work starts (run_flow,
# servers_command, require_prefect_server); the others open it before they run.
OPENS_STATE_FOLDER_ITSELF = {"run", "evaluate", "compare", "sweep", "servers", "deploy", "serve", "worker"}


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 the run (or command) failed, 2 bad input (config, state folder)."""
    global EXIT_CODE
    try:
        EXIT_CODE = run_command_line(argv)
    except SystemExit as stop:
        EXIT_CODE = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        raise
    except KeyboardInterrupt as interrupted:  # Ctrl-C: one line, not a traceback
        EXIT_CODE = 130
        report_error("interrupted (Ctrl-C); runs it left RUNNING are marked FAILED by the next run", interrupted)
    return EXIT_CODE


def run_command_line(argv: list[str] | None) -> int:
    global DEBUG
    args = build_parser().parse_args(argv)
    DEBUG = args.debug
    configure_environment(open_folder=False)  # each command opens the state folder where its work starts
    try:
        if args.command not in OPENS_STATE_FOLDER_ITSELF:
            open_state_folder()
        return COMMANDS[args.command](args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except (StateFolderError, UnsupportedTrackingUri) as error:  # bad input, found before anything started
        print(f"alignflow: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # one line and a log file, not a traceback on the terminal
        report_error(f"{type(error).__name__}: {error}", error)
        return 1


def cli() -> None:
    """The ``alignflow`` command."""
    global STANDALONE
    STANDALONE = True
    sys.exit(main())


if __name__ == "__main__":
    cli()
