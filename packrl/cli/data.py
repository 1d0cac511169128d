"""`packrl data gsm8k`: GSM8K jsonl -> verl's RL parquet (see `packrl.data.verl_gsm8k`);
`packrl data tool-traces`: calculator traces for `packrl sft` (see `packrl.data.traces`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def _cmd_gsm8k(args: argparse.Namespace) -> int:
    from packrl.data.verl_gsm8k import write_verl_gsm8k

    sources = {"train": args.train, "test": args.test}
    if args.input_dir is not None:
        sources = {split: path or args.input_dir / f"{split}.jsonl" for split, path in sources.items()}
    missing = [split for split, path in sources.items() if path is None]
    if missing:
        print(f"packrl data gsm8k: no {' or '.join('--' + m for m in missing)} file; give --input-dir DIR holding "
              "train.jsonl and test.jsonl, or --train FILE --test FILE", file=sys.stderr)
        return 2
    out = args.out.expanduser()
    try:
        accounts = [write_verl_gsm8k(Path(path).expanduser(), split, out / f"{split}.parquet") for split, path in sources.items()]
    except (ValueError, OSError) as err:
        print(f"packrl data gsm8k: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([a.to_dict() for a in accounts], indent=2))
    else:
        for account in accounts:
            print(account.summary())
        train, test = shlex.quote(f"data.train_files=[{out / 'train.parquet'}]"), shlex.quote(f"data.val_files=[{out / 'test.parquet'}]")
        print(f"train with: packrl train gsm8k {train} {test}")
    for account in accounts:
        if account.skipped:
            print(f"packrl data gsm8k: warning: {len(account.skipped)} {account.split} row(s) left out: no verl row can be "
                  f"made from them (listed above, or with --json); fix them in {account.source} to keep them", file=sys.stderr)
    return 0


def _cmd_tool_traces(args: argparse.Namespace) -> int:
    from packrl.config import load_config
    from packrl.data.tool_traces import tool_trace_rows

    cfg = load_config(args.preset, args.overrides)
    out = args.out.expanduser()
    if out.is_dir():
        print(f"packrl data tool-traces: --out={str(args.out)!r} is a folder; give the jsonl file to write, "
              "e.g. --out traces.jsonl", file=sys.stderr)
        return 2
    try:
        rows = tool_trace_rows(cfg.data, cfg.sft.num_rows, cfg.train.seed)
    except ValueError as err:
        print(f"packrl data tool-traces: {err}", file=sys.stderr)
        return 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    except OSError as err:
        print(f"packrl data tool-traces: --out={str(out)!r} cannot be written ({err}); choose a writable --out path",
              file=sys.stderr)
        return 2
    arith = cfg.data.arithmetic
    print(f"wrote {len(rows)} calculator traces ({arith.digits}-digit, {arith.num_operands} operands, operators "
          f"{arith.operators!r}) to {out}")
    command = ["packrl", "sft", *([args.preset] if args.preset else []), *args.overrides, f"sft.train_files=[{out}]", "sft.total_steps=50"]
    print(f"fine-tune with: {shlex.join(command)}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``packrl data`` and its ``gsm8k`` subcommand."""
    p = sub.add_parser("data", help="prepare datasets in verl's RL parquet schema",
                       description="Write datasets as verl's examples/data_preprocess scripts do, from local files.")
    datasets = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    g = datasets.add_parser(
        "gsm8k", help="GSM8K jsonl -> train.parquet and test.parquet in verl's schema",
        description="Convert local GSM8K jsonl files (question/answer rows) into OUT/train.parquet and OUT/test.parquet "
        "with verl's columns: data_source, prompt, ability, reward_model, extra_info. Rows without a '#### <number>' "
        "answer are left out, counted and listed.",
    )
    g.add_argument("--input-dir", type=Path, default=None, help="folder holding train.jsonl and test.jsonl")
    g.add_argument("--train", type=Path, default=None, help="the train jsonl (default: INPUT_DIR/train.jsonl)")
    g.add_argument("--test", type=Path, default=None, help="the test jsonl (default: INPUT_DIR/test.jsonl)")
    g.add_argument("--out", type=Path, required=True, help="folder to write train.parquet and test.parquet to")
    g.add_argument("--json", action="store_true", help="print the row accounting as JSON")
    g.set_defaults(func=_cmd_gsm8k)
    t = datasets.add_parser(
        "tool-traces", help="synthetic calculator traces of task:arithmetic for packrl sft (jsonl of messages)",
        description="Write sft.num_rows traces of PRESET's task:arithmetic problems (data.arithmetic, train.seed; never a "
        "validation question) as jsonl rows of 'messages': the prompt as RL renders it (data.system_prompt, "
        "data.instruction), a <tool_call> with the problem's expression, the calculator's answer as a tool message, "
        "and the final answer after '####'.",
    )
    t.add_argument("preset", nargs="?", default=None, help="preset name or .yaml path (e.g. arithmetic_tool)")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.arithmetic.digits=3 sft.num_rows=1024")
    t.add_argument("--out", type=Path, required=True, help="the jsonl file to write")
    t.set_defaults(func=_cmd_tool_traces)
