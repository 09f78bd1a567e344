"""What the terminal shows when the machinery around a run misbehaves: a Prefect server too slow to start, a reader
that closes the pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import demo_recipe

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


def test_show_schema_into_a_closed_pipe_exits_quietly():
    out = subprocess.run(
        f"{BIN / 'alignpipe'} show --schema | head -1", shell=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "{" and "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr


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
