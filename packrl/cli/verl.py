"""`packrl verl KEY=VALUE ...`: run the packrl equivalent of a verl launch script.

The overrides are verl's, as written after ``python3 -m verl.trainer.main_ppo`` (``key=value``,
``+key=value``, ``++key=value``). `packrl.compat.verl.translate` turns them into the ``gsm8k``
preset plus packrl overrides; ``--dry-run`` prints that command, every mapping with its unit
conversion, the verl keys packrl ignores with the reason, and the resolved config, and trains
nothing. When ``actor_rollout_ref.model.path`` is local, the model's config is read and prompt +
response budgets beyond its context are refused here (a hub id is not downloaded: the dry run says
the context was not checked). Exit status: 0 done, 2 a key verl does not have, a value packrl
cannot honour, or a problem in the translated config (each named with the verl keys it came
from). See docs/verl.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from packrl.errors import ConfigProblem

if TYPE_CHECKING:
    from packrl.config.schema import RunConfig


def count_rows(files: list[str]) -> int | None:
    """Rows of local ``.parquet``/``.jsonl``/``.json`` files (None when any is not such a file),
    for verl's ``trainer.total_epochs``. Parquet row counts come from the footer alone."""
    total = 0
    for name in files:
        path = Path(name)
        try:
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
            elif path.suffix == ".jsonl":
                with path.open("rb") as f:
                    total += sum(1 for line in f if line.strip())
            elif path.suffix == ".json":
                total += len(json.loads(path.read_text(encoding="utf-8")))
            else:
                return None
        except (ImportError, OSError, ValueError, TypeError):  # no pyarrow, no file, not a table: not counted
            return None
    return total


def model_context_problems(cfg: RunConfig) -> tuple[list[ConfigProblem], str | None]:
    """Prompt + response budgets against the model's context, read from the model's config when
    ``model.path`` is a local directory or file (`packrl.config.budgets.budgets_of_model`, the
    check `packrl train` and `packrl preflight` make); nothing is downloaded.

    Returns:
        ``(problems, note)``: the budget problems only the context reveals, each also naming
        ``model.path`` (so the message names ``actor_rollout_ref.model.path`` too), or one problem
        when the local config cannot be read; ``note`` says why the context was not checked (a
        hub id or alias), else None.
    """
    from packrl.config.budgets import budget_problems, budgets_of, budgets_of_model
    from packrl.models.model_config import ModelConfigFileError, apply_rope_scaling, load_model_config

    path = cfg.model.path
    if not Path(path).expanduser().exists():
        return [], (f"the model context was not checked: model.path={path} is not a local path (a hub id is not downloaded "
                    "here); packrl train and packrl preflight check data.max_prompt_tokens + rollout.max_response_tokens "
                    "against it once the model is reachable")
    try:
        model_config = apply_rope_scaling(load_model_config(path), cfg.model.rope_scaling)
        with_context = budget_problems(budgets_of_model(cfg, model_config))
    except ModelConfigFileError as err:
        return [ConfigProblem("model.path", path, err.problem, err.fix)], None
    except ValueError as err:
        return [ConfigProblem("model.path", path, f"the model context cannot be read: {err}",
                              "point actor_rollout_ref.model.path at a model directory with a config.json")], None
    known = {str(p) for p in budget_problems(budgets_of(cfg))}
    return [replace(p, keys=(*p.involved_keys, "model.path")) for p in with_context if str(p) not in known], None


def _cmd_verl(args: argparse.Namespace) -> int:
    from packrl.compat.verl import sources_of, train_files_of, translate
    from packrl.config import ConfigError, check_config, to_yaml

    try:
        translation = translate(args.overrides, num_train_rows=count_rows(train_files_of(args.overrides)))
    except ConfigError as err:
        print(f"packrl verl: {err}", file=sys.stderr)
        return 2
    cfg, problems, bad = check_config(translation.preset, translation.overrides)
    context_problems, unchecked = model_context_problems(cfg) if not bad & {"model.path", "model.rope_scaling"} else ([], None)
    problems += context_problems
    print(translation.command())
    print(translation.report())
    if args.dry_run:  # a translation made here for another machine: what this one lacks is only a warning
        for problem in [p for p in problems if p.machine]:
            print(f"packrl verl: warning: {problem} (the translation is printed anyway; training needs it)", file=sys.stderr)
        problems = [p for p in problems if not p.machine]
        if unchecked:
            print(f"packrl verl: note: {unchecked}", file=sys.stderr)
    if problems:
        lines = [f"packrl verl: the translated config has {len(problems)} problem(s):"]
        for problem in problems:
            source = sources_of(translation, problem)
            lines.append(f"  - {problem}" + (f" (from verl: {source})" if source else ""))
        print("\n".join(lines), file=sys.stderr)
        return 2
    if args.dry_run:
        print("resolved config:")
        print(to_yaml(cfg), end="")
        return 0
    from packrl.cli.training import train_and_report

    return train_and_report(cfg, "packrl verl")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `packrl verl` on the `packrl` subcommand parser ``sub``."""
    p = sub.add_parser(
        "verl",
        help="run the packrl equivalent of a verl command (verl's key=value overrides as written)",
        description="Translate verl's Hydra overrides (key=value, +key=value, ++key=value, as passed to "
        "python3 -m verl.trainer.main_ppo) into the packrl config they describe and train it. Every unit "
        "conversion and every ignored verl key is printed; keys verl does not have and values packrl cannot "
        "honour are refused with the fix. See docs/verl.md.",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="verl overrides, e.g. data.train_batch_size=256")
    p.add_argument("--dry-run", action="store_true",
                   help="print the packrl command, the conversions, the ignored keys and the resolved config; train nothing")
    p.set_defaults(func=_cmd_verl)
