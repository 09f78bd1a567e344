"""What the terminal shows when the machinery around a run misbehaves (a Prefect server too slow to start, a reader
that closes the pipe), and how a stage's progress bar shares stderr with the log."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from support import demo_recipe, known

BIN = Path(sys.executable).parent


def test_a_temporary_server_that_does_not_start_in_time_gives_one_clear_message(tiny, tmp_path):
    recipe = tmp_path / "demo.yaml"
    recipe.write_text(demo_recipe(tiny, tmp_path / "runs"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0")
    out = subprocess.run(
        [str(BIN / "alignpipe"), "run", str(recipe)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "Prefect's temporary server did not start in time" in out.stderr
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=300" in out.stderr and "PREFECT_API_URL" in out.stderr
    assert not (tmp_path / "runs" / "tiny-demo" / "stages").exists(), "nothing ran"


def test_a_prefect_server_that_does_not_answer_gives_one_clear_message(tiny, tmp_path):
    """PREFECT_API_URL set to a server that is down: `run` (plain, and with a work pool to check first) and `deploy`
    say which server and what to do, with no traceback, and exit 1."""
    from alignpipe.launch import free_port

    recipe = tmp_path / "demo.yaml"
    recipe.write_text(demo_recipe(tiny, tmp_path / "runs"))
    api = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_API_URL=api)
    for args in (
        ["run", str(recipe)],
        ["run", str(recipe), "--set", "stages.sft.resources.pool=gpu"],
        ["deploy", "--pool", "gpu"],
    ):
        out = subprocess.run([str(BIN / "alignpipe"), *args], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 1, (args, out.stderr[-3000:])
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        assert f"error: the Prefect server at {api} (PREFECT_API_URL) cannot be reached" in out.stderr, out.stderr
        assert "prefect server start" in out.stderr
    assert not (tmp_path / "runs" / "tiny-demo" / "stages").exists(), "nothing ran"


def test_show_schema_into_a_closed_pipe_exits_quietly():
    out = subprocess.run(
        f"{BIN / 'alignpipe'} show --schema | head -1", shell=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "{" and "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr


def test_every_command_is_in_the_readme_and_every_option_says_what_it_does():
    """The README's command block lists each subcommand `alignpipe --help` offers, and each option and argument of
    each has its own help text (`--set` of `show` and `deploy`, `make-tiny`'s arguments once had none)."""
    import argparse
    import re

    from alignpipe.cli import build_parser

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = known(re.search(r"## Command line\n\n```\n(.*?)```", readme, flags=re.S)).group(1)
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {line.split()[1] for line in block.splitlines() if line.startswith("alignpipe ")} == set(subparsers.choices)
    for name, parser in subparsers.choices.items():
        for action in parser._actions:
            assert action.help, (name, action.dest)


def test_deploy_with_nothing_to_deploy_or_a_pipeline_option_without_its_recipe_stops_before_prefect(
    monkeypatch, capsys
):
    """`alignpipe deploy` alone once started a temporary Prefect server, deployed nothing and exited 0; `--cron`
    without `--recipe` was dropped unseen. Both exit 2 with the fix, before any server is asked."""
    import types

    from alignpipe.cli import main

    # Prefect stays unimported: imported here, its console handler would keep capsys's stream, closed after this test
    monkeypatch.setitem(sys.modules, "flows.deploy", types.ModuleType("flows.deploy"))  # any use of it fails
    assert main(["deploy"]) == 2
    err = capsys.readouterr().err
    assert "error: nothing was deployed" in err and "pass --pool POOL" in err and "--recipe RECIPE" in err
    assert main(["deploy", "--pool", "gpu", "--cron", "0 3 * * 1", "--name", "weekly"]) == 2
    err = capsys.readouterr().err
    assert "--cron belongs to the pipeline deployment" in err and "--name belongs" in err and "--set" not in err
    assert main(["deploy", "--pipeline-pool", "cpu", "--set", "seed=1"]) == 2
    err = capsys.readouterr().err
    assert "--pipeline-pool belongs" in err and "--set belongs" in err
    assert main(["show"]) == 2
    assert "error: show needs a RECIPE" in capsys.readouterr().err


def test_importing_alignpipe_turns_mlflow_telemetry_off_unless_the_user_set_it():
    """MLflow reads MLFLOW_DISABLE_TELEMETRY (and DO_NOT_TRACK only when "true"). With telemetry on, its client
    fetches a config from a background thread that, offline, removes an environment variable while the stage may be
    reading the environment: here no client and no such thread."""
    code = (
        "import alignpipe, mlflow, os, threading; from mlflow.telemetry import get_telemetry_client; "
        "print(os.environ['MLFLOW_DISABLE_TELEMETRY'], get_telemetry_client(), "
        "any(t.name == 'GetTelemetryConfig' for t in threading.enumerate()))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["true", "None", "False"]
    run = subprocess.run(
        [sys.executable, "-c", "import alignpipe, os; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"],
        env={**env, "MLFLOW_DISABLE_TELEMETRY": "false"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == "false"  # the user's choice stands


def _shared(live: bool):
    from alignpipe.shared_line import SharedLine

    stream = io.StringIO()
    shared = SharedLine(stream, live)
    return shared, stream, shared.log_stream()


def _log(log, text: str) -> None:
    log.write(text + "\n")  # as a console handler writes a record: one call, its newline included


def test_on_a_terminal_a_log_line_clears_the_progress_bar_and_the_bar_is_drawn_again_below_it():
    shared, stream, log = _shared(live=True)
    shared.write("\rsft:   5%| | 8/150")
    shared.write("\rsft:   7%| | 10/150 loss=5.3")
    _log(log, "[sft] step 10 loss=5.3")
    shared.write("\rsft:   8%| | 11/150 loss=5.3")
    shared.write("\rsft: 100%|#| 150/150\n")
    _log(log, "[sft] stage done")
    assert stream.getvalue().replace("\r\x1b[K", "<clear>") == (
        "sft:   5%| | 8/150<clear>sft:   7%| | 10/150 loss=5.3"  # each redraw erases the line first
        "<clear>[sft] step 10 loss=5.3\n"  # the bar erased, the log line in its place
        "sft:   7%| | 10/150 loss=5.3"  # the bar again, under it
        "<clear>sft:   8%| | 11/150 loss=5.3<clear>sft: 100%|#| 150/150\n"
        "[sft] stage done\n"  # after a finished bar's newline: nothing to clear or redraw
    )


def test_on_a_terminal_side_by_side_stages_keep_a_line_each_and_log_lines_go_above_them():
    """A recipe's parallel branches (tiny-dpo's `rm` and `dpo`): their bars are a block of lines at the bottom, one
    per stage, where they took turns on one line; a log line, or a stage's finished bar, goes above the block."""
    shared, stream, log = _shared(live=True)
    up = "\x1b[A\x1b[K"
    shared.write("\rreward:   0%| | 0/60", "rm")
    shared.write("\rdpo:   0%| | 0/60", "dpo")
    shared.write("\rreward:  17%| | 10/60", "rm")
    log.write("[rm] reward step 10")  # a record's text, its newline in a second write: held until the line ends
    log.write("/60\n")
    shared.write("\rreward: 100%| | 60/60\n", "rm")
    shared.write("\rdpo:  17%| | 10/60", "dpo")
    assert stream.getvalue().replace("\r\x1b[K", "<clear>").replace(up, "<up>") == (
        "reward:   0%| | 0/60"
        "<clear>reward:   0%| | 0/60\ndpo:   0%| | 0/60"  # a second stage: a second line
        "<clear><up>reward:  17%| | 10/60\ndpo:   0%| | 0/60"  # back to the block's first line, both drawn again
        "<clear><up>[rm] reward step 10/60\nreward:  17%| | 10/60\ndpo:   0%| | 0/60"  # the log line above them
        "<clear><up>reward: 100%| | 60/60\ndpo:   0%| | 0/60"  # rm's finished bar stays above
        "<clear>dpo:  17%| | 10/60"  # the block is dpo's line alone
    )


def test_a_stage_that_ends_with_its_bar_half_drawn_leaves_it_behind_and_the_others_go_on():
    """A stage killed mid-step (its timeout, the OOM killer) never ends its bar's line: the launcher says its stream
    ended (`finish`), and the bar stays as it was, on a line of its own, no longer redrawn under the others."""
    shared, stream, _ = _shared(live=True)
    up = "\x1b[A\x1b[K"
    shared.write("\rreward:  40%| | 24/60", "rm")
    shared.write("\rdpo:  17%| | 10/60", "dpo")
    shared.finish("rm")
    shared.finish("judge")  # a stage that drew nothing: nothing to do
    shared.write("\rdpo:  18%| | 11/60", "dpo")
    assert stream.getvalue().replace("\r\x1b[K", "<clear>").replace(up, "<up>") == (
        "reward:  40%| | 24/60<clear>reward:  40%| | 24/60\ndpo:  17%| | 10/60"
        "<clear><up>reward:  40%| | 24/60\ndpo:  17%| | 10/60"  # rm's last state above, dpo's block under it
        "<clear>dpo:  18%| | 11/60"
    )
    shared, stream, _ = _shared(live=False)
    shared.write("\rreward:  40%| | 24/60", "rm")
    shared.finish("rm")
    shared.write("\rdpo:  17%| | 10/60", "dpo")
    assert stream.getvalue().splitlines() == ["reward:  40%| | 24/60", "dpo:  17%| | 10/60"]


def test_on_a_terminal_a_bar_is_cut_to_the_terminal_s_width(monkeypatch):
    """A line wider than the terminal wraps to two screen lines, and erasing the block would go up one too few."""
    monkeypatch.setenv("COLUMNS", "12")
    shared, stream, _ = _shared(live=True)
    shared.write("\rsft:  7%|#         | 10/150", "sft")
    assert stream.getvalue() == "sft:  7%|# "  # 11 characters: the last column left free, as tqdm leaves it


def test_in_a_log_file_each_bar_update_is_a_line_and_log_lines_never_start_mid_line():
    shared, stream, log = _shared(live=False)
    shared.write("\rsft:   0%| | 0/150")
    shared.write("\rsft:   7%| | 10/150 loss=5.3")
    _log(log, "[sft] step 10 loss=5.3")
    shared.write("\rsft:  12%| | 19/150 loss=5.3")
    _log(log, "[sft] eval loss=4.9")
    shared.write("\n")  # the bar's own line end, after a log line already ended it: no blank line
    shared.write("\rsft:  13%| | 20/150 loss=3.5\r")
    shared.write("sft: 100%|#| 150/150\r\n")
    shared.write("Traceback (most recent call last):\n\n  File ...\n")
    _log(log, "[sft] stage done")
    assert stream.getvalue().splitlines() == [
        "sft:   0%| | 0/150",
        "sft:   7%| | 10/150 loss=5.3",
        "[sft] step 10 loss=5.3",
        "sft:  12%| | 19/150 loss=5.3",
        "[sft] eval loss=4.9",
        "sft:  13%| | 20/150 loss=3.5",
        "sft: 100%|#| 150/150",
        "Traceback (most recent call last):",
        "",  # a blank line of the stage's own is kept
        "  File ...",
        "[sft] stage done",
    ]
    assert "\r" not in stream.getvalue()


def test_in_a_log_file_a_bar_drawn_again_unchanged_as_it_closes_is_not_repeated():
    """tqdm draws its last state again as it closes; in a file that was the same line twice, around the log line of
    the last step, its rate read again (the demo's log: 14.53it/s, then 14.52). A line the stage repeats on purpose
    (not a redrawn bar) stays, as does a bar that differs outside its timings."""
    shared, stream, log = _shared(live=False)
    bar = "sft: 100%|#| 150/150 [00:07<00:00, 19.17it/s, loss=0.8445]"
    shared.write("\rsft:  93%|#| 140/150 [00:07<00:00, 19.01it/s, loss=0.8422]", "sft")
    shared.write("\r" + bar, "sft")
    _log(log, "[sft] sft step 150/150 loss=0.8445")
    closing = bar.replace("19.17", "19.16")
    shared.write("\r" + closing[:40], "sft")  # the close's redraw, read in two chunks, the second inside its timings
    shared.write(closing[40:] + "\n", "sft")
    shared.write("\rjudge:   0%| | 0/96", "judge")
    shared.write("\rjudge: 100%| | 96/96", "judge")
    shared.write("\rjudge: 100%| | 96/96\n", "judge")  # drawn again with no log line between
    shared.write("\rjudge: 100%| | 9", "judge")  # begins as the last bar did, then differs
    shared.write("7/97\n", "judge")
    shared.write("\rjudge: 100%| | 97/97 [00:01<00:00]", "judge")
    shared.write("\rjudge: 100%| | 97/97 [00:01<00:00] done\n", "judge")  # alike in its timings, not after them
    shared.write("warning: slow\nwarning: slow\n", "judge")
    _log(log, "[judge] done")
    assert stream.getvalue().splitlines() == [
        "sft:  93%|#| 140/150 [00:07<00:00, 19.01it/s, loss=0.8422]",
        bar,
        "[sft] sft step 150/150 loss=0.8445",
        "judge:   0%| | 0/96",
        "judge: 100%| | 96/96",
        "judge: 100%| | 97/97",
        "judge: 100%| | 97/97 [00:01<00:00]",
        "judge: 100%| | 97/97 [00:01<00:00] done",
        "warning: slow",
        "warning: slow",
        "[judge] done",
    ]


def test_mlflow_s_transfer_bars_stay_out_of_a_stage_s_log_unless_its_bars_are_live_or_the_user_asks(monkeypatch):
    from alignpipe import stage

    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal, whoever runs the tests
    for tty, user, want in (("0", None, "false"), ("1", None, None), ("0", "true", "true")):
        monkeypatch.setenv("ALIGNPIPE_TTY", tty)
        if user is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, user)
        stage._quiet_libraries()
        assert os.environ.get(key) == want, (tty, user)


def test_a_stage_s_library_warnings_reach_the_launcher_once_marked_with_their_level():
    """A stage process logs on stdout for the launcher. huggingface_hub and datasets also give their loggers a
    stderr handler of their own, so their records (the Hub's retries) once reached the launcher twice, raw on stderr
    and through the root logger; now once, on stdout, each line of a warning or an error marked with its level."""
    code = """
import logging
from alignpipe.stage import log_to_launcher
log_to_launcher()
from huggingface_hub.utils import logging as hub_logging
from datasets.utils import logging as datasets_logging
hub_logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
datasets_logging.get_logger("datasets.load").warning("using the cache")
logging.getLogger("alignpipe.stage").info("stage s (format) started")
try:
    raise ValueError("no such column")
except ValueError:
    logging.getLogger("alignpipe.stage").exception("stage s failed: no such column")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == [
        "WARNING: Retrying in 1s [Retry 1/5].",
        "WARNING: using the cache",
        "stage s (format) started",
        "ERROR: stage s failed: no such column",
    ]
    assert lines[4] == "ERROR: Traceback (most recent call last):" and lines[-1] == "ERROR: ValueError: no such column"
    assert all(line.startswith("ERROR: ") for line in lines[4:])


def test_the_launcher_reads_a_stage_line_s_level_and_logs_it_there():
    import logging

    from alignpipe.log_levels import level_of

    assert level_of("WARNING: Retrying in 1s") == (logging.WARNING, "Retrying in 1s")
    assert level_of("ERROR: stage s failed: x") == (logging.ERROR, "stage s failed: x")
    assert level_of("CRITICAL: out of memory") == (logging.CRITICAL, "out of memory")
    assert level_of("[rank1]:ERROR: stage s failed: x") == (logging.ERROR, "[rank1]:stage s failed: x")
    for plain in ("sft step 10/150 loss=5.3", "Warning: not a mark", "INFO: not marked", "ERROR:no space"):
        assert level_of(plain) == (logging.INFO, plain)


def test_stages_running_side_by_side_share_one_line_so_their_bars_never_run_together():
    """Two stages of a recipe's parallel branches, launched by one process: their bars go through the process's one
    `SharedLine` for stderr, and in a log file each update is a whole line."""
    from alignpipe.shared_line import for_stream

    stream = io.StringIO()
    rm, dpo = for_stream(stream, live=False), for_stream(stream, live=False)
    assert rm is dpo and for_stream(io.StringIO(), live=False) is not rm
    log = rm.log_stream()
    rm.write("\rreward:   0%| | 0/60", "rm")
    dpo.write("\rdpo:   0%| | 0/60", "dpo")
    _log(log, "[rm] reward step 10/60")
    dpo.write("\rdpo:  17%| | 10", "dpo")
    rm.write("\rreward: 100%| | 60/60\n", "rm")  # rm's line begins while dpo's is unfinished
    dpo.write("/60", "dpo")
    assert stream.getvalue().splitlines() == [
        "reward:   0%| | 0/60",
        "dpo:   0%| | 0/60",
        "[rm] reward step 10/60",
        "dpo:  17%| | 10",
        "reward: 100%| | 60/60",
        "/60",
    ]


def test_the_launcher_s_log_handlers_on_stderr_write_through_the_shared_line(monkeypatch):
    """Every handler writing to the stream (a plain `StreamHandler`; Prefect's console handler, whose rich Console
    holds the stream too) is pointed at `log_stream()`, so a record logged from any thread (Prefect's own "Finished
    in state" lines too, not only the stage's) starts a line of its own."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    from alignpipe.shared_line import SharedLine

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    shared = SharedLine(stream, live=False)
    plain, console = logging.StreamHandler(stream), PrefectConsoleHandler(stream=stream)
    elsewhere = logging.StreamHandler(io.StringIO())
    last_resort = type(known(logging.lastResort))(logging.CRITICAL)  # its stream is whatever sys.stderr is: left alone
    logger = logging.getLogger("alignpipe.test.shared_line")
    logger.propagate = False
    for handler in (plain, console, elsewhere, last_resort):
        logger.addHandler(handler)
    try:
        assert shared.guard_log_handlers() == 2
        assert shared.guard_log_handlers() == 0  # already pointed at it
        assert console.console.file is not stream and elsewhere.stream is not stream
        shared.write("\rsft:   7%| | 10/150", "sft")
        logger.warning("step 10")
        shared.write("\rsft:   8%| | 11/150\n", "sft")
    finally:
        for handler in (plain, console, elsewhere, last_resort):
            logger.removeHandler(handler)
    assert stream.getvalue().splitlines() == ["sft:   7%| | 10/150", "step 10", "step 10", "sft:   8%| | 11/150"]


def test_under_the_launcher_a_bar_reports_its_state_on_stdout_at_its_start_every_few_seconds_and_at_its_end(
    monkeypatch, capsys
):
    from alignpipe import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    for asked in ("0", "1"):
        monkeypatch.setenv(progress.REPORT_ENV, asked)
        with progress.progress(20, "sft") as bar:
            for step in range(20):
                bar.update(1)
                if step == 9:
                    bar.set_postfix({"loss": 1.7})
        with progress.progress(8, "judge", enabled=False) as bar:  # another process's bar: drawn by rank 0 alone
            bar.update(8)
    lines = capsys.readouterr().out.splitlines()
    reports = [progress.parse_report(line) for line in lines]
    assert all(r is not None for r in reports), lines  # none while nobody asked (ALIGNPIPE_PROGRESS=0)
    assert reports == [  # the first update, the end (steps 2 to 19 came within REPORT_EVERY_S); none twice
        {"n": 1, "total": 20, "desc": "sft", "postfix": ""},
        {"n": 20, "total": 20, "desc": "sft", "postfix": "loss=1.7"},
    ]
    assert progress.parse_report("sft step 10/150 loss=5.3") is None
    assert progress.parse_report("[rank0]:" + lines[0]) == reports[0]
    assert progress.parse_report(progress.PROGRESS_MARK + "not json") is None


def test_the_launcher_hands_a_stage_s_reports_to_on_progress_and_never_logs_them(tiny, tmp_path):
    """`launch` with `on_progress`: the stage's bars report (an SFT stage here), the reports reach the callback in
    order, end at the bar's total, and no report line reaches `on_line`."""
    from support import sft_spec_after_format

    from alignpipe.launch import launch
    from alignpipe.recipe import load_recipe

    recipe_path = tmp_path / "demo.yaml"
    recipe_path.write_text(demo_recipe(tiny, tmp_path / "runs"))
    recipe = load_recipe(recipe_path, ["stages.sft.max_steps=20", "stages.sft.eval_every=null"])
    _, spec, _ = sft_spec_after_format(recipe)
    lines: list[str] = []
    reports: list[dict] = []
    launch(spec, on_line=lines.append, on_progress=reports.append)
    assert reports and reports[-1]["n"] == reports[-1]["total"] == 20 and reports[-1]["desc"] == "sft", reports
    assert reports[-1]["postfix"].startswith("loss=")
    assert [r["n"] for r in reports] == sorted(r["n"] for r in reports)
    assert any("sft step 20/20" in line for line in lines)
    assert not any("alignpipe-progress" in line for line in lines)


def test_the_summary_table_shows_a_failure_s_message_as_written_cut_after_a_word():
    """A message is text, not rich markup: `[bf16]` stays and `[/x]` does not break the table; a long one ends with
    a whole word and `…` (the log above has it whole)."""
    from rich.console import Console

    from alignpipe.summary import MESSAGE_CHARS, clip, print_summary

    message = "stage 'sft' failed (exit code 1): dtype [bf16] needs a GPU; see [/tmp/x] " + "and more words " * 20
    summary = {
        "pipeline": "p",
        "pipeline_run_id": "r",
        "stages": [
            {"stage_id": "sft", "kind": "sft", "status": "failed", "message": message, "duration_s": 0, "output": ""}
        ],
    }
    console = Console(record=True, width=400)
    print_summary(summary, console)
    shown = console.export_text()
    assert "dtype [bf16] needs a GPU; see [/tmp/x]" in shown, shown
    assert re.search(r" (and|more|words)…", shown), shown
    assert clip("short", 10) == "short" and clip("one two three", 9) == "one two…" and clip("x" * 12, 5) == "xxxx…"
    assert len(clip(message, MESSAGE_CHARS)) <= MESSAGE_CHARS


def test_validate_of_a_recipe_naming_no_pool_or_secret_block_does_not_import_prefect():
    """`validate` asks the Prefect server only about what a recipe names there; importing Prefect alone costs it a
    second (0.5 s → 1.7 s here), so its pre-flight module imports Prefect only when asked."""
    code = "import sys, flows.preflight, alignpipe.cli; assert 'prefect' not in sys.modules, 'prefect imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
