"""alignpipe: declarative RLHF pipelines (format → SFT → reward → PPO/DPO/GRPO → judge → push) on Prefect."""

import os as _os

# Usage telemetry off unless the user turns it on (set any of these themselves), for every entry point: the CLI, a
# flow a Prefect worker runs, a stage process, the benchmarks. Besides sending data out, MLflow's telemetry client
# fetches its config from a background thread and, on a machine without internet access, then removes an
# environment variable from that thread; a stage reading `os.environ` at that moment died with a KeyError
# ('_MLFLOW_TELEMETRY_SESSION_ID'). MLflow reads MLFLOW_DISABLE_TELEMETRY, and DO_NOT_TRACK only when it is "true".
for _key, _value in (
    ("MLFLOW_DISABLE_TELEMETRY", "true"),
    ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    ("DO_NOT_TRACK", "1"),
):
    _os.environ.setdefault(_key, _value)

__version__ = "0.1.0"
