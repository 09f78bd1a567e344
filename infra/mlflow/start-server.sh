#!/usr/bin/env bash
# A standalone MLflow server over the same SQLite store the pipelines write by default.
# Usage: infra/mlflow/start-server.sh [WORKDIR] [PORT]     (then set tracking.uri: http://127.0.0.1:PORT)
set -euo pipefail
workdir=${1:-./runs}
port=${2:-5000}
mkdir -p "$workdir/mlartifacts"
export MLFLOW_DISABLE_TELEMETRY=${MLFLOW_DISABLE_TELEMETRY:-true}   # no usage data sent; set false to send it
exec "${VENV:-.venv}/bin/mlflow" server \
  --backend-store-uri "sqlite:///$(cd "$workdir" && pwd)/mlflow.db" \
  --artifacts-destination "$(cd "$workdir" && pwd)/mlartifacts" \
  --host 127.0.0.1 --port "$port"
