#!/usr/bin/env bash
# Set up the project's virtual environment at the versions of the lock, infra/constraints.txt (once per change of
# pyproject.toml or the lock), then run a job.
#   bash infra/bootstrap.sh demo [args]   the main job on the embedded default
#   bash infra/bootstrap.sh test [args]   the test suite without the end-to-end tier (-m "not e2e");
#                                         `test -m e2e` runs that tier (a later -m replaces the first);
#                                         on COMLRL_TEST_WORKERS (default 2) pytest-xdist workers (`-n 0`: one process)
#   bash infra/bootstrap.sh test --latest [args]
#                                         the same suite in a new venv (.venv-latest) holding the newest versions
#                                         pyproject.toml's ranges admit, no lock; only if it passes, that venv's
#                                         freeze becomes the lock (review the change, then commit it)
# The test job also installs the PostgreSQL stack (the `postgres` extra and, as root on Debian, the
# postgresql package) for tests/test_production_stack.py; COMLRL_POSTGRES=1 asks for it with the demo
# (bash infra/servers.sh start --postgres), COMLRL_POSTGRES=0 skips it for the tests. It also installs the
# browser of tests/test_ui_browser.py (the `browser` extra and, as root on Debian, chromium and chromium-driver);
# COMLRL_BROWSER=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

LOCK=infra/constraints.txt
LOCK_TABLE=docs/getting-started.md  # its table of the lock's main versions follows the lock
VENV="${COMLRL_VENV:-.venv}"
VENV="${VENV%/}"
PYTHON="${PYTHON:-python3}"
job="${1:-demo}"
shift || true
LATEST=0
if [[ "$job" == test && "${1:-}" == --latest ]]; then
    LATEST=1
    shift
    VENV+="-latest"  # never the locked venv
fi
STAMP="$VENV/.comlrl-installed"
if [[ "$job" == test ]]; then POSTGRES="${COMLRL_POSTGRES:-1}"; else POSTGRES="${COMLRL_POSTGRES:-0}"; fi
if [[ "$job" == test ]]; then BROWSER="${COMLRL_BROWSER:-1}"; else BROWSER=0; fi
EXTRAS="pipeline,lora,test"
[[ "$job" != test ]] || EXTRAS+=",docs"
[[ "$POSTGRES" != 1 ]] || EXTRAS+=",postgres"
[[ "$BROWSER" != 1 ]] || EXTRAS+=",browser"
WANT="$(sha256sum pyproject.toml "$LOCK" | cut -d' ' -f1 | tr '\n' ' ')$EXTRAS"

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

# The lock's header, then the freeze of $VENV (setuptools included: torch requires it; pip itself not), each local
# version label dropped: `torch==2.13.0` takes this machine's CPU build (2.13.0+cpu) where it lies on disk, PyPI's
# elsewhere.
write_lock() {
    echo "# The versions the test suite passed with. Every pip install of infra/bootstrap.sh applies them"
    echo "# (pip install -c $LOCK ...); pyproject.toml keeps the ranges that library users install from."
    echo "# Made by \`bash infra/bootstrap.sh test --latest\` (the newest versions the ranges admit, the suite green)"
    echo "# on $(date -u +%F), Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')," \
         "extras $EXTRAS:"
    echo "# \`pip freeze --all --exclude-editable --exclude pip\` of that venv, local labels (+cpu) dropped."
    "$VENV/bin/pip" freeze --all --exclude-editable --exclude pip | sed -E 's/^([^=]+==[^+]+)\+.*$/\1/'
}

# After a green `test --latest`: its venv's freeze becomes the lock, and each `| name | version |` row of the docs'
# table follows it.
adopt_candidate() {
    local name version
    cp "$CANDIDATE" "$LOCK"
    for name in $(sed -nE 's/^\| ([A-Za-z0-9._-]+) \| [^ |]+ \|$/\1/p' "$LOCK_TABLE"); do
        version="$(grep -i "^$name==" "$LOCK" | cut -d= -f3 || true)"
        [[ -z "$version" ]] || sed -i -E "s/^\| $name \| [^ |]+ \|$/| $name | $version |/" "$LOCK_TABLE"
    done
    git diff --stat -- "$LOCK" "$LOCK_TABLE" || true
    echo "the suite passed with the newest versions: $LOCK now holds them (and $LOCK_TABLE's table);" \
         "review the change (git diff $LOCK), then commit it"
}

if [[ "$LATEST" == 1 ]]; then
    echo "creating virtual environment $VENV afresh: the newest versions pyproject.toml's ranges admit, no lock"
    "$PYTHON" -m venv --clear "$VENV"
    # The CPU build of torch 2.13.0 where it is available (it lies on this machine's disk);
    # otherwise whatever the project's range admits.
    "$VENV/bin/pip" install --quiet "torch==2.13.0" || "$VENV/bin/pip" install --quiet "torch>=2.6,<=2.14.1"
    "$VENV/bin/pip" install --quiet -e ".[$EXTRAS]"
    CANDIDATE="$(cd "$VENV" && pwd)/comlrl-lock-candidate.txt"
    write_lock > "$CANDIDATE"
    export COMLRL_LOCK="$CANDIDATE"  # the lock tests/test_install_lock.py checks in this run
else
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "creating virtual environment $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
        echo "installing comlrl and its dependencies into $VENV at the versions of $LOCK (a few minutes the first time)"
        "$VENV/bin/pip" install --quiet -c "$LOCK" -e ".[$EXTRAS]" || {
            echo "pip could not install the versions of $LOCK (its message above says why); if pyproject.toml's" \
                 "ranges changed, move the lock with bash infra/bootstrap.sh test --latest" >&2
            exit 1
        }
        echo "$WANT" > "$STAMP"
    fi
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
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
        if [[ "$LATEST" == 1 ]]; then
            if [[ $status -ne 0 ]]; then
                echo "the suite did not pass with the newest versions (exit status $status): $LOCK is unchanged" >&2
                exit $status
            fi
            adopt_candidate
        fi
        exit $status
        ;;
    *)
        echo "usage: bash infra/bootstrap.sh {demo|test} [args]" >&2
        exit 2
        ;;
esac
