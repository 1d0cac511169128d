"""The `packrl` command: `packrl config`, `train`, `sft`, `preflight`, `audit`, `report`, `view`,
`verl` (run verl command lines) and `data` (write verl-schema data, tool-call traces)."""

from __future__ import annotations

import argparse
import sys

from packrl import __version__
from packrl.cli import audit, report, view
from packrl.config import ConfigError, load_config, preset_names, to_yaml


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides)
    print(to_yaml(cfg), end="")
    if args.budgets:
        from packrl.config.budgets import budget_problems, budgets_of, budgets_of_model, budgets_table
        from packrl.config.plan import BatchPlan
        from packrl.models.model_config import apply_rope_scaling, load_model_config

        print()
        unknown_context = None
        try:
            budgets = budgets_of_model(cfg, apply_rope_scaling(load_model_config(cfg.model.path), cfg.model.rope_scaling))
        except ValueError as err:
            budgets, unknown_context = budgets_of(cfg, max_context_tokens=None), err
        print(budgets_table(budgets))
        print(BatchPlan.from_config(cfg).summary())
        if unknown_context is not None:
            print(f"model context unknown, so prompt + response <= context was NOT checked: {unknown_context}", file=sys.stderr)
            return 2
        return 0 if not budget_problems(budgets) else 2
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from packrl.cli.training import train_and_report

    return train_and_report(load_config(args.preset, args.overrides), "packrl train")


def _cmd_sft(args: argparse.Namespace) -> int:
    from packrl.cli.training import train_and_report
    from packrl.config.sft_rules import sft_load_problems
    from packrl.trainer.sft import sft

    return train_and_report(load_config(args.preset, args.overrides, rules=sft_load_problems, warnings=None), "packrl sft", run=sft)


def _add_preset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", nargs="?", default=None, help="preset name or .yaml path (default: demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.max_prompt_tokens=1024")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packrl",
        description="RL post-training for LLMs with sequence length as a budgeted resource.",
    )
    parser.add_argument("--version", action="version", version=f"packrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "config",
        help="print the resolved config of a preset with key=value overrides",
        description="Resolve PRESET (a shipped name or a .yaml path) plus dotted key=value overrides, "
        "check every value, and print the result as YAML. Presets: " + ", ".join(preset_names()) + ".",
    )
    _add_preset_args(p)
    p.add_argument("--budgets", action="store_true", help="also print the token-budget plan and the batch plan")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser(
        "train",
        help="run RL training (GRPO by default) from a preset with key=value overrides",
        description="Train with PRESET (demo, gsm8k or a .yaml path) plus dotted key=value overrides. "
        "Writes RUN_DIR (train.out_dir, default runs/<timestamp>) with metrics.jsonl and checkpoints.",
    )
    _add_preset_args(p)
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat traces (sft.*) with the same budgets, packing and micro-batching",
        description="Fine-tune model.path on sft.train_files (jsonl rows of 'messages', or task:tool_traces) for "
        "sft.total_steps steps of sft.batch_size traces; tool messages stay out of the loss. Writes RUN_DIR like "
        "packrl train; its checkpoints/step_N loads as model.path of an RL run.",
    )
    _add_preset_args(p)
    p.set_defaults(func=_cmd_sft)
    audit.add_parser(sub)
    report.add_parser(sub)
    from packrl.cli import preflight

    preflight.add_parser(sub)
    view.add_parser(sub)
    from packrl.cli import verl

    verl.add_parser(sub)
    from packrl.cli import data

    data.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    flags = [a for a in extra if a.startswith("-") or "=" not in a]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)} (overrides are written dotted.key=value)")
    if extra and not hasattr(args, "overrides"):
        parser.error(f"packrl {args.command} takes no key=value overrides: {' '.join(extra)}")
    if extra:  # overrides given after a flag, e.g. `config gsm8k --budgets rollout.n=4`
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return 0
    # A first positional with '=' is an override, not a preset.
    if getattr(args, "preset", None) and "=" in args.preset:
        args.overrides = [args.preset, *args.overrides]
        args.preset = None
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"packrl {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. while a command still imports torch; a run's own interrupt says more
        print(f"packrl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
