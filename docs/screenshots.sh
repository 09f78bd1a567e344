#!/usr/bin/env bash
# Remake the README's screenshots from a real browser: run the demo into a scratch workdir, start `mlflow ui` and
# `prefect server start` on its stores, and let headless Chromium (Debian: apt-get install chromium) capture the
# pages a user opens. Run from the repository root after `make install`; writes docs/img/*.png.
set -euo pipefail
WORK=${WORK:-/tmp/alignpipe-screenshots}
BIN=.venv/bin
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true
rm -rf "$WORK" && mkdir -p "$WORK"
$BIN/alignpipe run pipelines/tiny-demo.yaml --set "workdir=$WORK/runs" | tee "$WORK/run.log"
FLOW_RUN=$(grep -o 'alignpipe · tiny-demo · run [0-9a-f-]*' "$WORK/run.log" | awk '{print $NF}')
PARENT=$(grep -o 'parent run [0-9a-f]*' "$WORK/run.log" | awk '{print $NF}')
setsid $BIN/mlflow ui --backend-store-uri "sqlite:///$WORK/runs/mlflow.db" --port 5055 >"$WORK/mlflow.log" 2>&1 &
MLFLOW_PID=$!
setsid $BIN/prefect server start --port 4200 >"$WORK/prefect.log" 2>&1 &
PREFECT_PID=$!
trap 'kill -- -$MLFLOW_PID -$PREFECT_PID 2>/dev/null || true' EXIT  # each server with the workers it started
for url in http://127.0.0.1:5055/ http://127.0.0.1:4200/api/health; do
  for _ in $(seq 90); do curl -sf -o /dev/null "$url" && break; sleep 1; done
done
EXP=$($BIN/python -c "from mlflow.tracking import MlflowClient as C; print(C('sqlite:///$WORK/runs/mlflow.db').get_experiment_by_name('tiny-demo').experiment_id)")
shot() { chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size="$3" \
  --virtual-time-budget=20000 --screenshot="docs/img/$2" "$1" 2>/dev/null; }
shot "http://127.0.0.1:4200/runs/flow-run/$FLOW_RUN" prefect-run.png 1600,1000
shot "http://127.0.0.1:5055/#/experiments/$EXP/runs/$PARENT?workflowType=machine_learning" mlflow-parent.png 1600,1500
shot "http://127.0.0.1:5055/#/models/tiny-demo-sft?workflowType=machine_learning" mlflow-model.png 1600,700
