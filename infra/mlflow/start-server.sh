#!/usr/bin/env bash
# A standalone MLflow server over the same SQLite store the pipelines write by default.
# Usage: infra/mlflow/start-server.sh [WORKDIR] [PORT] [basic-auth]     (then set tracking.uri: http://127.0.0.1:PORT)
#
# With `basic-auth`, MLflow's basic-auth app (`pip install 'mlflow[auth]'`) asks every request for a user and
# password, and keeps users and permissions in WORKDIR/basic_auth.db. Its first start creates the user `admin` with the
# password in MLFLOW_AUTH_ADMIN_PASSWORD (12 characters or more); MLFLOW_FLASK_SERVER_SECRET_KEY signs its CSRF tokens
# (any random string, the same for every process of the server). A new user reads every experiment and writes only
# those it creates (default_permission = READ). A password checked once is taken for MLFLOW_AUTH_CACHE_TTL_SECONDS
# (60 by default; 0 checks its hash on every request, which a stage logging metrics pays for on each call; a password
# changed through another server process is honoured there after at most that long). The pipelines' side sets
# MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, and `alignpipe validate` says before a run what the server
# will refuse.
set -euo pipefail
workdir=${1:-./runs}
port=${2:-5000}
auth=${3:-}
mkdir -p "$workdir/mlartifacts"
root=$(cd "$workdir" && pwd)
export MLFLOW_DISABLE_TELEMETRY=${MLFLOW_DISABLE_TELEMETRY:-true}   # no usage data sent; set false to send it
app=()
case "$auth" in
  "") ;;
  basic-auth)
    : "${MLFLOW_AUTH_ADMIN_PASSWORD:?set it (12 characters or more): the password of the admin user the first start creates}"
    : "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set it to a random string (e.g. \$(openssl rand -hex 32)), the same on every server process}"
    cat > "$root/basic_auth.ini" <<INI
[mlflow]
default_permission = READ
database_uri = sqlite:///$root/basic_auth.db
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_TTL_SECONDS:-60}
INI
    export MLFLOW_AUTH_CONFIG_PATH="$root/basic_auth.ini"
    app=(--app-name basic-auth)
    ;;
  *) echo "start-server.sh: the third argument is basic-auth or nothing, not '$auth'" >&2; exit 2 ;;
esac
exec "${VENV:-.venv}/bin/mlflow" server "${app[@]}" \
  --backend-store-uri "sqlite:///$root/mlflow.db" \
  --artifacts-destination "$root/mlartifacts" \
  --host 127.0.0.1 --port "$port"
