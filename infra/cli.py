"""``alignflow`` command line."""

from __future__ import annotations

import argparse
import sys

from infra.settings import configure_environment


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow", description="Preference and RL training pipelines on Prefect, tracked in MLflow.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run the experiment flow",
        description="Run prepare → the configured stages (SFT → reference log-probs → DPO → GRPO by default) → evaluate for a config.",
        epilog="example: alignflow run configs/default.yaml dpo.beta=0.2 sft.num_train_epochs=10",
    )
    run.add_argument("config", nargs="?", help="experiment YAML (default: the built-in defaults)")
    run.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override config fields (values parsed as YAML)")
    return parser


def run_command(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from infra.config import load_config

    try:
        config = load_config(args.config, args.overrides)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        print(f"alignflow: invalid config: {error}", file=sys.stderr)
        return 2
    from flows.pipeline import experiment  # imported after configure_environment: Prefect reads it at import

    state = experiment(config, return_state=True)
    if not state.is_completed():
        print(f"alignflow: run {state.name}: {state.message}", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"run": run_command}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_environment()
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
