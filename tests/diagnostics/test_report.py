"""`packrl report`: a real 2-step run rendered in headless Chromium, plus graceful degradation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from packrl.cli.main import main
from packrl.diagnostics.report import load_run, write_report
from packrl.diagnostics.report_figures import as_number, series

CHROMIUM = shutil.which("chromium")
CORE_PLOTS = {"length", "finish", "padding", "reward", "timing", "throughput"}
"""Plots every run with metrics.jsonl has (sections drawn from metrics every step logs)."""


class _PlotScan(HTMLParser):
    """Finds `div.packrl-plot` containers and whether each holds plotly's `svg.main-svg`.

    Only <div> tags are counted to find where a container ends, so void elements and the SVG
    subtree's own tags cannot unbalance the scan.
    """

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.open: list[tuple[str, int]] = []  # (container id, div depth at its start)
        self.drawn: dict[str, bool] = {}
        self.errors_box: str | None = None
        self._in_errors = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        classes = (attr.get("class") or "").split()
        if tag == "div":
            self.depth += 1
            if "packrl-plot" in classes:
                self.open.append((attr.get("id") or "?", self.depth))
                self.drawn[attr.get("id") or "?"] = False
        if tag == "svg" and "main-svg" in classes:
            for plot_id, _ in self.open:
                self.drawn[plot_id] = True
        if attr.get("id") == "packrl-js-errors":
            self.errors_box = ""
            self._in_errors = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "div":
            if self.open and self.open[-1][1] == self.depth:
                self.open.pop()
            self.depth -= 1
        if tag == "pre":
            self._in_errors = False

    def handle_data(self, data: str) -> None:
        if self._in_errors:
            self.errors_box = (self.errors_box or "") + data


def _chromium(page: Path, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess:
    args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
            "--window-size=1400,4000", f"--user-data-dir={tmp_path / 'chromium-profile'}", *mode, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=180, check=False)


def _dump_dom(page: Path, tmp_path: Path) -> _PlotScan:
    done = _chromium(page, tmp_path, "--dump-dom")
    assert done.returncode == 0 and "</html>" in done.stdout, f"chromium --dump-dom failed: {done.stderr[-2000:]}"
    scan = _PlotScan()
    scan.feed(done.stdout)
    return scan


@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    """RUN_DIR of a real 2-step GRPO run of the tiny random policy, rollouts dumped, validation at step 2."""
    from packrl.config import load_config
    from packrl.distributed.local import local_group
    from packrl.trainer.loop import train
    from tests.diagnostics.tiny_run import tiny_policy

    smollm_tokenizer.padding_side = "left"
    out = tmp_path_factory.mktemp("report") / "run"
    cfg = load_config("demo", [
        f"train.out_dir={out}", "train.total_steps=2", "data.batch_size=2", "rollout.n=3",
        "rollout.max_response_tokens=12", "model.dtype=fp32", "train.lr=1e-3", "train.max_tokens_per_microbatch=192",
        "data.max_val_rows=3", "train.val_every=2", "train.dump_rollouts=true", "algorithm.kl_coef=0.01",
    ])
    return train(cfg, local_group(cfg, tiny_policy(smollm_tokenizer), smollm_tokenizer))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium; .ci/run "
                    "installs it), so report.html cannot be rendered in a headless browser")
def test_report_of_a_real_run_renders_in_headless_chromium(tiny_run_dir, tmp_path):
    assert sorted(p.name for p in (tiny_run_dir / "rollouts").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    assert main(["report", str(tiny_run_dir)]) == 0
    page = tiny_run_dir / "report.html"
    text = page.read_text()
    assert "<script src=" not in text and text.count("<script type=\"text/javascript\">") == 1  # one inlined bundle

    shot = tmp_path / "report.png"
    done = _chromium(page, tmp_path, f"--screenshot={shot}")
    assert done.returncode == 0 and shot.is_file(), f"chromium --screenshot failed: {done.stderr[-2000:]}"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000

    scan = _dump_dom(page, tmp_path)
    assert scan.errors_box == "", f"JavaScript errors while drawing the report:\n{scan.errors_box}"
    expected = {f"plot-{name}" for name in CORE_PLOTS | {"buckets"}}
    assert expected <= set(scan.drawn), f"plot containers missing: {expected - set(scan.drawn)}"
    undrawn = [plot_id for plot_id, drawn in scan.drawn.items() if not drawn]
    assert not undrawn, f"plot containers without a drawn svg.main-svg: {undrawn}"
    assert 'id="table-longest"' in text and 'id="table-truncated"' in text  # 12-token budget: random text hits it


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed, so the error hook cannot be exercised")
def test_error_hook_records_a_javascript_error(tmp_path):
    """The "no JavaScript errors" check above is only as good as the hook; a broken script must show."""
    run_dir = _metrics_only_run(tmp_path)
    page = write_report(run_dir)
    page.write_text(page.read_text().replace("</body>", "<script>notDefinedAnywhere();</script></body>"))
    scan = _dump_dom(page, tmp_path)
    assert "notDefinedAnywhere" in (scan.errors_box or "")


def _metrics_only_run(tmp_path: Path, steps: int = 3) -> Path:
    """A RUN_DIR with metrics.jsonl only: no config.yaml, no rollout dumps, no bucket metrics."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = []
    for step in range(1, steps + 1):
        lines.append(json.dumps({
            "step": step, "response_length/mean": 10.0 + step, "response_length/min": 3, "response_length/max": 20,
            "response_length/clip_ratio": 0.25, "response/finish_reason/eos": 0.75, "response/finish_reason/length": 0.25,
            "critic/score/mean": 0.1 * step, "timing_s/gen": 1.0, "timing_s/update_actor": 0.5, "timing_s/step": 1.6,
            "perf/throughput": "nan" if step == 2 else 250.0, "seqlen/pad_fraction": 0.0,
        }))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 4, "cut by a ki')  # a killed run's last line
    return run_dir


def test_metrics_only_run_degrades_to_notes(tmp_path):
    run_dir = _metrics_only_run(tmp_path)
    run = load_run(run_dir)
    assert [m["step"] for m in run.metrics] == [1, 2, 3] and run.skipped_lines == {"metrics.jsonl": 1}
    assert run.rollouts == {} and run.config == {}
    page = write_report(run_dir, tmp_path / "elsewhere.html")
    assert page == tmp_path / "elsewhere.html" and not (run_dir / "report.html").exists()
    text = page.read_text()
    plots = set(re.findall(r'<div class="packrl-plot" id="plot-([a-z]+)"', text))
    assert plots == CORE_PLOTS  # score alone draws the reward plot, pad fraction alone the padding plot
    assert 'id="note-buckets"' in text and 'id="note-responses"' in text
    assert "train.dump_rollouts=true" in text  # the notes say how to get the missing sections
    assert "micro-batch fill needs train.max_tokens_per_microbatch" in text
    assert "response_length/min|mean|max" in text  # lengths come from metrics, not percentiles


def test_sections_without_metrics_show_notes(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "actor/pg_loss": 0.5}\n')
    text = write_report(run_dir).read_text()
    assert 'class="packrl-plot"' not in text
    for name in (*CORE_PLOTS, "buckets", "responses"):
        assert f'id="note-{name}"' in text, name


def test_truncated_note_when_no_response_was_cut(tmp_path):
    run_dir = _metrics_only_run(tmp_path, steps=1)
    (run_dir / "rollouts").mkdir()
    row = {"step": 1, "index": 0, "prompt": "What is 1 + 1?", "response": "<b>2</b>", "prompt_tokens": 9,
           "response_tokens": 3, "finish_reason": "eos", "truncated": False, "score": 1.0, "reward": 1.0, "advantage": 0.5}
    (run_dir / "rollouts" / "step_1.jsonl").write_text(json.dumps(row) + "\n")
    text = write_report(run_dir).read_text()
    assert 'id="table-longest"' in text and 'id="note-truncated"' in text and 'id="table-truncated"' not in text
    assert "&lt;b&gt;2&lt;/b&gt;" in text  # response text is escaped, never markup
    assert "p10-p90 band" in text  # lengths come from the dumps


@pytest.mark.parametrize("make", ["missing_dir", "no_metrics", "empty_metrics"])
def test_not_a_run_exits_2_with_a_message(tmp_path, capsys, make):
    run_dir = tmp_path / "run"
    if make != "missing_dir":
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text("train: {}\n")
    if make == "empty_metrics":
        (run_dir / "metrics.jsonl").write_text("\n")
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    expected = {"missing_dir": "is not a folder", "no_metrics": "has no metrics.jsonl", "empty_metrics": "no step record"}
    assert err.startswith("packrl report: ") and expected[make] in err and str(run_dir) in err
    assert not (run_dir / "report.html").exists()


@pytest.mark.parametrize(("value", "expected"), [
    (3, 3.0), (0.5, 0.5), ("2.5", 2.5), ("nan", None), ("inf", None), (float("nan"), None),
    (True, None), (None, None), ("x", None),
])
def test_as_number_keeps_finite_numbers_only(value, expected):
    assert as_number(value) == expected


def test_series_skips_steps_without_a_finite_value():
    metrics = [{"step": 1, "a": 1.0}, {"step": 2, "a": "nan"}, {"step": 3}, {"step": 4, "a": 4}]
    assert series(metrics, "a") == ([1, 4], [1.0, 4.0])


def test_out_that_is_a_directory_is_refused_and_leaves_nothing(tmp_path):
    from packrl.diagnostics.report import write_report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    target = tmp_path / "outdir"
    target.mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        write_report(run_dir, target)
    assert not list(tmp_path.glob(".*.tmp")) and list(target.iterdir()) == []
    nested = write_report(run_dir, tmp_path / "new" / "deeper" / "r.html")  # parent folders are created
    assert nested.is_file() and not list(nested.parent.glob(".*.tmp"))


def test_a_multi_turn_run_gets_a_turns_plot(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "num_turns/mean": 1.5, "num_turns/max": 3, "multi_turn/tool_calls": 0.5 * s,
              "multi_turn/malformed_calls": 0.1, "multi_turn/tool_errors": 0.0, "multi_turn/tool_use_rate": 0.25} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    text = write_report(run_dir).read_text()
    assert 'id="plot-turns"' in text and "tool-use rate" in text


def test_a_partial_rollout_run_gets_a_staleness_plot(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "async/staleness_token_mean": 0.5, "async/staleness_token_max": 1, "async/partial_ratio": 0.5,
              "async/carried_groups": 2, "async/must_finish_groups": 0, "async/dropped_groups": 0} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    text = write_report(run_dir).read_text()
    assert 'id="plot-staleness"' in text and "token staleness (mean, updates)" in text
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    (sync_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    assert "trainer.rollout_mode=sync" in write_report(sync_dir).read_text()
