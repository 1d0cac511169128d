"""`packrl verl KEY=VALUE ...`: run the packrl equivalent of a verl launch script.

The overrides are verl's, as written after ``python3 -m verl.trainer.main_ppo`` (``key=value``,
``+key=value``, ``++key=value``). `packrl.compat.verl.translate` turns them into the ``gsm8k``
preset plus packrl overrides; ``--dry-run`` prints that command, every mapping with its unit
conversion, the verl keys packrl ignores with the reason, and the resolved config, and trains
nothing. Exit status: 0 done, 2 a key verl does not have, a value packrl cannot honour, or a
problem in the translated config (each named with the verl keys it came from). See docs/verl.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def _cmd_verl(args: argparse.Namespace) -> int:
    from packrl.compat.verl import sources_of, train_files_of, translate
    from packrl.config import ConfigError, check_config, to_yaml

    try:
        translation = translate(args.overrides, num_train_rows=count_rows(train_files_of(args.overrides)))
    except ConfigError as err:
        print(f"packrl verl: {err}", file=sys.stderr)
        return 2
    cfg, problems, _ = check_config(translation.preset, translation.overrides)
    print(translation.command())
    print(translation.report())
    if args.dry_run:  # a translation made here for another machine: what this one lacks is only a warning
        for problem in [p for p in problems if p.machine]:
            print(f"packrl verl: warning: {problem} (the translation is printed anyway; training needs it)", file=sys.stderr)
        problems = [p for p in problems if not p.machine]
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
