#!/usr/bin/env bash
# Start, stop or check a local Prefect server and MLflow tracking server (infra/README.md: which to use when).
#   bash infra/servers.sh start              SQLite back ends: one file each, nothing else to run
#   bash infra/servers.sh start --postgres   PostgreSQL back ends: one PostgreSQL on loopback with the databases
#                                            prefect and mlflow (compose.yaml's layout without containers)
#   bash infra/servers.sh stop               stop what this script started (PostgreSQL too)
#   bash infra/servers.sh status
#   bash infra/servers.sh db-stop [fast|immediate] / db-start
#                                            stop or start PostgreSQL alone, the servers staying up (maintenance;
#                                            `immediate` stops it as a crash would)
# start prints the variables to export. Settings (environment): COMLRL_SERVICES_DIR (default .comlrl/services),
# PREFECT_PORT (4200), MLFLOW_PORT (5000), POSTGRES_PORT (5433, beside a distribution's own cluster on 5432),
# COMLRL_BIND (127.0.0.1), COMLRL_VENV (.venv), COMLRL_START_TIMEOUT (120 s). The Prefect and MLflow servers bind
# to loopback unless COMLRL_BIND says otherwise; put an authenticating reverse proxy in front before exposing them
# (docs/pipeline.md). PostgreSQL always listens on 127.0.0.1 only, with password authentication; its passwords
# (generated at its first start unless PREFECT_DB_PASSWORD / MLFLOW_DB_PASSWORD / POSTGRES_PASSWORD are set then)
# and port are kept in the services directory's postgres.env (mode 600).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${COMLRL_VENV:-.venv}"
DIR="$(mkdir -p "${COMLRL_SERVICES_DIR:-.comlrl/services}" && cd "${COMLRL_SERVICES_DIR:-.comlrl/services}" && pwd)"
BIND="${COMLRL_BIND:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
PGDATA="$DIR/postgres"
export PREFECT_HOME="$DIR/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

running() { [[ -f "$DIR/$1.pid" ]] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

wait_for() {  # name url seconds
    local deadline=$((SECONDS + $3))
    until "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$2" 2>/dev/null; do
        if ! running "$1"; then echo "the $1 server exited; the end of $DIR/$1.log:" >&2; tail -n 5 "$DIR/$1.log" >&2; return 1; fi
        if (( SECONDS > deadline )); then echo "timed out waiting for $2" >&2; return 1; fi
        sleep 1
    done
}

# ----- PostgreSQL ----------------------------------------------------------------------------------------
pg_bin() {  # the directory of initdb and pg_ctl: on PATH, else Debian's newest /usr/lib/postgresql/N/bin
    local found
    if found="$(command -v initdb)" && [[ -x "$(dirname "$found")/pg_ctl" ]]; then
        dirname "$(readlink -f "$found")"
        return
    fi
    found="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    if [[ -z "$found" || ! -x "$found/initdb" ]]; then
        echo "PostgreSQL is not installed: apt-get install postgresql (bash infra/bootstrap.sh test does this as root)" >&2
        return 1
    fi
    echo "$found"
}

as_pg_user() {  # PostgreSQL refuses to run as root: as root, run its commands as the user postgres (else nobody)
    if [[ $EUID -ne 0 ]]; then "$@"; return; fi
    local user=postgres
    id -u postgres >/dev/null 2>&1 || user=nobody
    runuser -u "$user" -- "$@"
}

new_password() { "$VENV/bin/python" -c "import secrets; print(secrets.token_urlsafe(24))"; }

pg_settings() {  # the port and passwords: chosen at the first start, read back afterwards
    if [[ ! -f "$DIR/postgres.env" ]]; then
        (umask 077 && cat > "$DIR/postgres.env" <<EOF
POSTGRES_PORT=${POSTGRES_PORT:-5433}
POSTGRES_PASSWORD=${POSTGRES_PASSWORD:-$(new_password)}
PREFECT_DB_PASSWORD=${PREFECT_DB_PASSWORD:-$(new_password)}
MLFLOW_DB_PASSWORD=${MLFLOW_DB_PASSWORD:-$(new_password)}
EOF
        )
    fi
    # shellcheck disable=SC1091
    source "$DIR/postgres.env"
    local value
    for value in "$PREFECT_DB_PASSWORD" "$MLFLOW_DB_PASSWORD"; do  # they go into URLs and SQL unquoted
        if [[ ! "$value" =~ ^[A-Za-z0-9_.~-]+$ ]]; then
            echo "database passwords may hold only letters, digits and _ . ~ - (edit $DIR/postgres.env)" >&2
            return 1
        fi
    done
}

pg_init() {  # a new cluster in $PGDATA owned by the user PostgreSQL runs as, listening on loopback only
    [[ -f "$PGDATA/PG_VERSION" ]] && return
    mkdir -p "$PGDATA"
    touch "$DIR/postgres.log"
    if [[ $EUID -eq 0 ]]; then
        local user=postgres
        id -u postgres >/dev/null 2>&1 || user=nobody
        chown "$user" "$PGDATA" "$DIR/postgres.log"
        chmod 700 "$PGDATA"
        if ! as_pg_user test -w "$PGDATA"; then
            echo "the user $user cannot reach $PGDATA: every directory above it must be searchable by $user" \
                 "(chmod o+x), or set COMLRL_SERVICES_DIR to a directory it can reach" >&2
            return 1
        fi
    fi
    # The superuser's password through a file only that user can read (a pipe or here-string is root's).
    (umask 077 && echo "$POSTGRES_PASSWORD" > "$DIR/postgres.pw")
    [[ $EUID -ne 0 ]] || chown "$(stat -c %U "$PGDATA")" "$DIR/postgres.pw"
    local status=0
    as_pg_user "$PG_BIN/initdb" -D "$PGDATA" -U postgres --auth=scram-sha-256 --pwfile="$DIR/postgres.pw" \
        --encoding=UTF8 --locale=C.UTF-8 >"$DIR/initdb.log" 2>&1 || status=$?
    rm -f "$DIR/postgres.pw"
    if (( status != 0 )); then cat "$DIR/initdb.log" >&2; return 1; fi
    cat >> "$PGDATA/postgresql.conf" <<EOF

# infra/servers.sh: TCP on loopback only, no Unix socket (its default directory may not exist or be writable).
listen_addresses = '127.0.0.1'
port = $POSTGRES_PORT
unix_socket_directories = ''
EOF
}

pg_psql() {  # SQL on stdin, as the superuser over loopback
    PGPASSWORD="$POSTGRES_PASSWORD" "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$POSTGRES_PORT" \
        -U postgres -d postgres >/dev/null
}

pg_start() {
    PG_BIN="$(pg_bin)"
    pg_settings
    pg_init
    if ! as_pg_user "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
        as_pg_user "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$DIR/postgres.log" -w -t "${COMLRL_START_TIMEOUT:-120}" start \
            >/dev/null || { tail -n 20 "$DIR/postgres.log" >&2; return 1; }
    fi
    # Idempotent: a role and a database per server, as compose.yaml's two PostgreSQL services have.
    pg_psql <<EOF
SELECT format('CREATE ROLE %I LOGIN PASSWORD %L', name, password) FROM (VALUES
    ('prefect', '$PREFECT_DB_PASSWORD'), ('mlflow', '$MLFLOW_DB_PASSWORD')) AS wanted(name, password)
    WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name)\gexec
SELECT format('CREATE DATABASE %I OWNER %I', name, name) FROM (VALUES ('prefect'), ('mlflow')) AS wanted(name)
    WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = name)\gexec
EOF
}

pg_stop() {  # mode: fast (clients disconnected, a clean shutdown) or immediate (as a crash: recovery at the next start)
    [[ -f "$PGDATA/PG_VERSION" ]] || return 0
    PG_BIN="$(pg_bin)"
    if as_pg_user "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
        as_pg_user "$PG_BIN/pg_ctl" -D "$PGDATA" -m "${1:-fast}" -w stop >/dev/null
        echo "stopped postgres"
    fi
}

# ----- the servers ---------------------------------------------------------------------------------------
start() {
    local backend=sqlite
    if [[ "${1:-}" == "--postgres" ]]; then backend=postgres; elif [[ -n "${1:-}" ]]; then usage; fi
    if { running prefect || running mlflow; } && [[ "$(cat "$DIR/backend" 2>/dev/null || echo sqlite)" != "$backend" ]]; then
        echo "the servers in $DIR run on $(cat "$DIR/backend" 2>/dev/null || echo sqlite): stop them first" >&2
        return 1
    fi
    mkdir -p "$DIR/mlflow/artifacts" "$PREFECT_HOME"
    local prefect_db="sqlite+aiosqlite:///$DIR/prefect/prefect.db" mlflow_db="sqlite:///$DIR/mlflow/mlflow.db"
    if [[ "$backend" == postgres ]]; then
        pg_start
        prefect_db="postgresql+asyncpg://prefect:$PREFECT_DB_PASSWORD@127.0.0.1:$POSTGRES_PORT/prefect"
        mlflow_db="postgresql+psycopg://mlflow:$MLFLOW_DB_PASSWORD@127.0.0.1:$POSTGRES_PORT/mlflow"
    fi
    echo "$backend" > "$DIR/backend"
    # The database URLs travel in the environment, not on command lines that `ps` shows.
    if ! running prefect; then
        PREFECT_SERVER_API_HOST="$BIND" PREFECT_SERVER_API_PORT="$PREFECT_PORT" \
        PREFECT_API_DATABASE_CONNECTION_URL="$prefect_db" \
            setsid "$VENV/bin/prefect" server start --host "$BIND" --port "$PREFECT_PORT" \
            >"$DIR/prefect.log" 2>&1 &
        echo $! > "$DIR/prefect.pid"
    fi
    if ! running mlflow; then
        MLFLOW_BACKEND_STORE_URI="$mlflow_db" \
            setsid "$VENV/bin/mlflow" server --host "$BIND" --port "$MLFLOW_PORT" --workers 1 \
            --artifacts-destination "$DIR/mlflow/artifacts" >"$DIR/mlflow.log" 2>&1 &
        echo $! > "$DIR/mlflow.pid"
    fi
    wait_for prefect "http://$BIND:$PREFECT_PORT/api/health" "${COMLRL_START_TIMEOUT:-120}"
    wait_for mlflow "http://$BIND:$MLFLOW_PORT/health" "${COMLRL_START_TIMEOUT:-120}"
    echo "export PREFECT_API_URL=http://$BIND:$PREFECT_PORT/api"
    echo "export MLFLOW_TRACKING_URI=http://$BIND:$MLFLOW_PORT"
}

stop() {
    local name pid
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
    pg_stop fast
}

status() {
    local name
    for name in prefect mlflow; do
        if running "$name"; then
            echo "$name running (pid $(cat "$DIR/$name.pid"), $(cat "$DIR/backend" 2>/dev/null || echo sqlite), log $DIR/$name.log)"
        else
            echo "$name stopped"
        fi
    done
    if [[ -f "$PGDATA/PG_VERSION" ]]; then
        PG_BIN="$(pg_bin)"
        if as_pg_user "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
            echo "postgres running (port $(sed -n 's/^POSTGRES_PORT=//p' "$DIR/postgres.env"), log $DIR/postgres.log)"
        else
            echo "postgres stopped"
        fi
    fi
}

usage() {
    echo "usage: bash infra/servers.sh {start [--postgres]|stop|status|db-stop [fast|immediate]|db-start}" >&2
    exit 2
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop) stop ;;
    status) status ;;
    db-stop) [[ "${2:-fast}" =~ ^(fast|immediate)$ ]] || usage; pg_stop "${2:-fast}" ;;
    db-start) pg_start ;;
    *) usage ;;
esac
