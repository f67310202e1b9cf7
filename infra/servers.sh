#!/usr/bin/env bash
# Start, stop or check a local Prefect server and MLflow tracking server (SQLite back ends).
#   bash infra/servers.sh start     start both on loopback; prints the variables to export
#   bash infra/servers.sh stop      stop both (the pids this script recorded)
#   bash infra/servers.sh status
# Settings (environment): COMLRL_SERVICES_DIR (default .comlrl/services), PREFECT_PORT (4200),
# MLFLOW_PORT (5000), COMLRL_BIND (127.0.0.1). Both servers bind to loopback unless COMLRL_BIND
# says otherwise; put an authenticating reverse proxy in front before exposing them (docs/pipeline.md).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${COMLRL_VENV:-.venv}"
DIR="$(mkdir -p "${COMLRL_SERVICES_DIR:-.comlrl/services}" && cd "${COMLRL_SERVICES_DIR:-.comlrl/services}" && pwd)"
BIND="${COMLRL_BIND:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
export PREFECT_HOME="$DIR/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

wait_for() {  # url seconds
    local deadline=$((SECONDS + $2))
    until "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; do
        if (( SECONDS > deadline )); then echo "timed out waiting for $1" >&2; return 1; fi
        sleep 1
    done
}

start() {
    mkdir -p "$DIR/mlflow/artifacts" "$PREFECT_HOME"
    if [[ ! -f "$DIR/prefect.pid" ]] || ! kill -0 "$(cat "$DIR/prefect.pid")" 2>/dev/null; then
        PREFECT_SERVER_API_HOST="$BIND" PREFECT_SERVER_API_PORT="$PREFECT_PORT" \
        PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$DIR/prefect/prefect.db" \
            setsid "$VENV/bin/prefect" server start --host "$BIND" --port "$PREFECT_PORT" \
            >"$DIR/prefect.log" 2>&1 &
        echo $! > "$DIR/prefect.pid"
    fi
    if [[ ! -f "$DIR/mlflow.pid" ]] || ! kill -0 "$(cat "$DIR/mlflow.pid")" 2>/dev/null; then
        setsid "$VENV/bin/mlflow" server --host "$BIND" --port "$MLFLOW_PORT" --workers 1 \
            --backend-store-uri "sqlite:///$DIR/mlflow/mlflow.db" \
            --artifacts-destination "$DIR/mlflow/artifacts" >"$DIR/mlflow.log" 2>&1 &
        echo $! > "$DIR/mlflow.pid"
    fi
    wait_for "http://$BIND:$PREFECT_PORT/api/health" "${COMLRL_START_TIMEOUT:-120}"
    wait_for "http://$BIND:$MLFLOW_PORT/health" "${COMLRL_START_TIMEOUT:-120}"
    echo "export PREFECT_API_URL=http://$BIND:$PREFECT_PORT/api"
    echo "export MLFLOW_TRACKING_URI=http://$BIND:$MLFLOW_PORT"
}

stop() {
    for name in prefect mlflow; do
        if [[ -f "$DIR/$name.pid" ]]; then
            pid="$(cat "$DIR/$name.pid")"
            # setsid made each server a process-group leader: stop the group (its workers too).
            kill -TERM -- "-$pid" 2>/dev/null || true
            for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -KILL -- "-$pid" 2>/dev/null || true
            rm -f "$DIR/$name.pid"
            echo "stopped $name"
        fi
    done
}

status() {
    for name in prefect mlflow; do
        if [[ -f "$DIR/$name.pid" ]] && kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null; then
            echo "$name running (pid $(cat "$DIR/$name.pid"), log $DIR/$name.log)"
        else
            echo "$name stopped"
        fi
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: bash infra/servers.sh {start|stop|status}" >&2; exit 2 ;;
esac
