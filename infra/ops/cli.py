"""``alignflow`` command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from infra.ops import service_cli
from infra.ops.cache_cli import add_cache_parser, cache_command
from infra.settings import configure_environment


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignflow", description="Preference and RL training pipelines on Prefect, tracked in MLflow."
    )
    parser.add_argument("--version", action="version", version=f"alignflow {importlib.metadata.version('alignflow')}")
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
    service_cli.add_parsers(commands)
    return parser


def finished(state) -> int:
    if not state.is_completed():
        print(f"alignflow: run {state.name}: {state.message}", file=sys.stderr)
        return 1
    return 0


def load_or_exit(schema, args: argparse.Namespace):
    """The validated config, or exit 2 with the error (and near matches for unknown keys); with
    ``--print-config``, print the resolved config as YAML and exit 0."""
    import yaml
    from pydantic import ValidationError

    from infra.config import did_you_mean, load_config

    try:
        config = load_config(args.config, args.overrides, schema)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        print(f"alignflow: invalid config: {error}", file=sys.stderr)
        for hint in did_you_mean(error, schema) if isinstance(error, ValidationError) else []:
            print(hint, file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        raise SystemExit(0)
    return config


# The config is validated before anything heavy is imported (torch, Prefect, the flows), so a bad
# file fails at once; flows are imported after configure_environment: Prefect reads it at import.
def run_command(args: argparse.Namespace) -> int:
    from infra.config import ExperimentConfig

    config = load_or_exit(ExperimentConfig, args)
    from flows.pipeline import experiment

    return finished(experiment(config, return_state=True))


def evaluate_command(args: argparse.Namespace) -> int:
    from infra.config import EvaluationRequest

    request = load_or_exit(EvaluationRequest, args)
    from flows.evaluation import evaluation

    return finished(evaluation(request, return_state=True))


def compare_command(args: argparse.Namespace) -> int:
    from flows.compare import compare

    chosen = {"metrics": args.metrics, "curves": args.curves, "stage": args.stage}
    chosen |= {"filter": args.filter, "runs": args.runs, "last": args.last}
    options = {k: v for k, v in chosen.items() if v}
    return finished(compare(experiment=args.experiment, baseline=args.baseline, **options, return_state=True))


COMMANDS = {
    "run": run_command,
    "evaluate": evaluate_command,
    "compare": compare_command,
    "cache": cache_command,
    **service_cli.COMMANDS,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_environment()
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
