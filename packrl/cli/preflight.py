"""`packrl preflight`: check a run from its configs before anything loads (see `packrl.inspect.preflight`)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_preflight(args: argparse.Namespace) -> int:
    from packrl.inspect.preflight import preflight

    try:
        report = preflight(args.preset, args.overrides, device_memory_gib=args.device_memory, device=args.device)
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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: estimate process RSS; cuda: estimate device memory (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(func=_cmd_preflight)
