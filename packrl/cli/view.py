"""`packrl view RUN_DIR [--step N]`: browse a run's rollout dumps in the terminal.

Needs ``RUN_DIR/rollouts/step_N.jsonl``, written when training ran with
``train.dump_rollouts=true``. Keys: ``l`` sort by response length (again: reverse), ``r`` sort
by reward, ``o`` batch order, ``f`` cycle the finish-reason filter, ``tab`` next pane, ``q``
quit. Exit status: 0 after quitting, 2 when there is nothing to view (a message, not a
traceback). See docs/view.md.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_view(args: argparse.Namespace) -> int:
    # The TUI library loads only for this command, so `packrl train` does not pay its import.
    from packrl.diagnostics.viewer import RolloutViewer, load_run

    if getattr(args, "overrides", None):
        print(f"packrl view: unexpected argument(s) {' '.join(args.overrides)}; usage: packrl view RUN_DIR [--step N]", file=sys.stderr)
        return 2
    try:
        app = RolloutViewer(load_run(args.run_dir), args.run_dir, initial_step=args.step)
    except (ValueError, OSError) as err:
        print(f"packrl view: {err}", file=sys.stderr)
        return 2
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("packrl view: needs an interactive terminal (stdin and stdout are not one); for a file view of the "
              f"same data run `packrl report {args.run_dir}`", file=sys.stderr)
        return 2
    app.run()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `packrl view` on the `packrl` subcommand parser ``sub``."""
    p = sub.add_parser(
        "view",
        help="browse the rollout dumps of a run in the terminal",
        description="Show RUN_DIR/rollouts/step_N.jsonl (written with train.dump_rollouts=true): the steps with "
        "mean reward, mean response length and truncated fraction; the samples of a step, sortable by length (l) "
        "or reward (r), filterable by finish reason (f); and the prompt and response text of a sample.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `packrl train`")
    p.add_argument("--step", type=int, default=None, metavar="N", help="open step N first (default: the first step)")
    p.set_defaults(func=_cmd_view, overrides=[])  # main() appends stray key=value words here; they are refused
