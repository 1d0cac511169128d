"""`packrl report RUN_DIR [--out FILE]`: write a run's self-contained HTML report.

The page (default ``RUN_DIR/report.html``) shows response lengths, finish reasons, padding,
reward, stage time, throughput, length-bucketed metrics and the longest and truncated
responses; see docs/report.md. Exit status: 0 when written, 2 when RUN_DIR is not a run
(no ``metrics.jsonl``) or the page cannot be written (a message, not a traceback).
"""

from __future__ import annotations

import argparse
import sys


def _cmd_report(args: argparse.Namespace) -> int:
    from packrl.diagnostics.report import write_report

    try:
        path = write_report(args.run_dir, args.out)
    except (ValueError, OSError) as err:
        print(f"packrl report: {err}", file=sys.stderr)
        return 2
    print(f"report written: {path} ({path.stat().st_size:,} bytes)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `packrl report` on the `packrl` subcommand parser."""
    p = sub.add_parser(
        "report",
        help="write RUN_DIR/report.html: lengths, padding, reward, stage time per step (offline HTML)",
        description="Write a self-contained HTML report of a training run (RUN_DIR, the train.out_dir of "
        "`packrl train`): response-length percentiles, clip ratio and finish reasons, pad fraction and "
        "micro-batch fill, reward and validation accuracy, stage time, throughput, length-bucketed metrics "
        "and the longest and truncated responses. Opens offline in any browser.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl")
    p.add_argument("--out", metavar="FILE", default=None, help="where to write the page (default: RUN_DIR/report.html)")
    p.set_defaults(func=_cmd_report)
