"""`packrl preflight`: check a run from its configs before anything loads (see `packrl.inspect.preflight`)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_table(args: argparse.Namespace) -> int:
    from packrl.inspect.fit_table import DEFAULT_MEMORY_GIB, fit_table

    if args.device_memory is not None:
        print("packrl preflight: --device-memory checks one run against one device; --table takes its sizes from "
              "--memory-gib GiB ...", file=sys.stderr)
        return 2
    values = args.memory_gib or []
    overrides = [*args.overrides, *(v for v in values if "=" in v)]  # key=value after --memory-gib's sizes
    try:
        sizes = tuple(float(v) for v in values if "=" not in v) or DEFAULT_MEMORY_GIB
    except ValueError:
        print(f"packrl preflight: --memory-gib {' '.join(values)}: give one or more positive sizes in GiB, e.g. 24 80",
              file=sys.stderr)
        return 2
    try:
        table = fit_table(args.preset, overrides, memory_gib=sizes, device=args.device or "cuda")
    except ValueError as err:
        print(f"packrl preflight: {err}", file=sys.stderr)
        return 2
    print(json.dumps(table.to_dict(), indent=2) if args.json else table.to_text())
    return 0


def _cmd_preflight(args: argparse.Namespace) -> int:
    from packrl.inspect.preflight import preflight

    if args.table:
        return _cmd_table(args)
    if args.memory_gib:
        print("packrl preflight: --memory-gib sizes the --table; to check this run against one device use "
              "--device-memory GiB", file=sys.stderr)
        return 2
    try:
        report = preflight(args.preset, args.overrides, device_memory_gib=args.device_memory, device=args.device or "cpu")
    except ValueError as err:
        print(f"packrl preflight: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return 0 if report.ok else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preflight",
        help="find every budget, batch and memory problem of a run from its configs, before any weights load",
        description="Check PRESET plus key=value overrides against the model's config.json (never its weights): "
        "every config problem, prompt + response vs the model context (with a RoPE scaling proposal), LoRA targets, "
        "and the memory per device with the largest train.max_tokens_per_microbatch that fits. "
        "Exit status: 0 no problems, 1 problems found, 2 bad arguments.",
    )
    p.add_argument("preset", nargs="?", default=None, help="preset name or .yaml path (default: demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.max_tokens_per_microbatch=8192")
    p.add_argument("--device-memory", type=float, default=None, metavar="GiB", help="memory per device to check against, in GiB")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu: estimate process RSS; cuda: estimate device memory (default: cpu, and cuda with --table)")
    p.add_argument("--table", action="store_true",
                   help="print, per device memory size, the longest prompt + response that fits and the "
                   "train.max_tokens_per_microbatch to use, for plain training, gradient checkpointing, LoRA and param offload")
    p.add_argument("--memory-gib", nargs="+", default=None, metavar="GiB",
                   help="device memory sizes for --table (default: 24 40 80 141)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(func=_cmd_preflight)
