#!/usr/bin/env bash
# Set up the project's virtual environment (once per pyproject.toml change), then run a job.
#   bash infra/bootstrap.sh demo [args]   the main job on the embedded default
#   bash infra/bootstrap.sh test [args]   the test suite without the end-to-end tier (-m "not e2e");
#                                         `test -m e2e` runs that tier (a later -m replaces the first);
#                                         on COMLRL_TEST_WORKERS (default 2) pytest-xdist workers (`-n 0`: one process)
# The test job also installs the PostgreSQL stack (the `postgres` extra and, as root on Debian, the
# postgresql package) for tests/test_production_stack.py; COMLRL_POSTGRES=1 asks for it with the demo
# (bash infra/servers.sh start --postgres), COMLRL_POSTGRES=0 skips it for the tests. It also installs the
# browser of tests/test_ui_browser.py (the `browser` extra and, as root on Debian, chromium and chromium-driver);
# COMLRL_BROWSER=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${COMLRL_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.comlrl-installed"
job="${1:-demo}"
if [[ "$job" == test ]]; then POSTGRES="${COMLRL_POSTGRES:-1}"; else POSTGRES="${COMLRL_POSTGRES:-0}"; fi
if [[ "$job" == test ]]; then BROWSER="${COMLRL_BROWSER:-1}"; else BROWSER=0; fi
EXTRAS="pipeline,lora,test"
[[ "$job" != test ]] || EXTRAS+=",docs"
[[ "$POSTGRES" != 1 ]] || EXTRAS+=",postgres"
[[ "$BROWSER" != 1 ]] || EXTRAS+=",browser"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"

# PostgreSQL itself (initdb, pg_ctl, psql) when it is missing, in Debian's /usr/lib/postgresql/N/bin where
# infra/servers.sh looks. servers.sh makes its own cluster (port 5433); the package's own (5432) is not used.
if [[ "$POSTGRES" == 1 ]] && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && ! command -v initdb >/dev/null; then
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "installing PostgreSQL (apt-get install postgresql) for the PostgreSQL-backed stack"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            postgresql >/dev/null; } || echo "apt-get could not install postgresql: tests/test_production_stack.py" \
            "is skipped" >&2
    else
        echo "PostgreSQL is not installed and this is not root with apt-get: install it (e.g. apt-get install" \
             "postgresql) or tests/test_production_stack.py is skipped" >&2
    fi
fi

# Debian's Chromium and its driver (the test passes both paths to Selenium; no browser is downloaded).
if [[ "$BROWSER" == 1 ]] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "installing Chromium (apt-get install chromium chromium-driver) for the browser test of the UIs"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium chromium-driver >/dev/null; } || echo "apt-get could not install chromium: tests/test_ui_browser.py" \
            "is skipped" >&2
    else
        echo "Chromium is not installed and this is not root with apt-get: install it (e.g. apt-get install" \
             "chromium chromium-driver) or tests/test_ui_browser.py is skipped" >&2
    fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
    echo "installing comlrl and its dependencies into $VENV (a few minutes the first time)"
    # The CPU build of torch 2.13.0 where it is available (it lies on this machine's disk);
    # otherwise whatever the project's range admits.
    "$VENV/bin/pip" install --quiet "torch==2.13.0" || "$VENV/bin/pip" install --quiet "torch>=2.6,<=2.14.1"
    "$VENV/bin/pip" install --quiet -e ".[$EXTRAS]"
    echo "$WANT" > "$STAMP"
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
shift || true
case "$job" in
    demo)
        exec "$VENV/bin/comlrl" demo "$@"
        ;;
    test)
        set +e
        # Two worker processes, each taking whole test modules (a module's fixtures are built once): most
        # tests wait on a child process, a server or the disk, so two halve the wall time on 2 cores.
        "$VENV/bin/python" -m pytest -m "not e2e" -n "${COMLRL_TEST_WORKERS:-2}" --dist loadfile "$@"
        status=$?
        if [[ $status -eq 5 ]]; then
            echo "pytest collected no tests: treating that as a failure" >&2
        fi
        exit $status
        ;;
    *)
        echo "usage: bash infra/bootstrap.sh {demo|test} [args]" >&2
        exit 2
        ;;
esac
