#!/usr/bin/env bash
# Set up the project's virtual environment (once per pyproject.toml change), then run a job.
#   bash infra/bootstrap.sh demo [args]   the main job on the embedded default
#   bash infra/bootstrap.sh test [args]   the test suite
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${COMLRL_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.comlrl-installed"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
    echo "installing comlrl and its dependencies into $VENV (a few minutes the first time)"
    # The CPU build of torch 2.13.0 where it is available (it lies on this machine's disk);
    # otherwise whatever the project's range admits.
    "$VENV/bin/pip" install --quiet "torch==2.13.0" || "$VENV/bin/pip" install --quiet "torch>=2.6,<=2.14.1"
    "$VENV/bin/pip" install --quiet -e ".[pipeline,lora,test]"
    echo "$WANT" > "$STAMP"
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
job="${1:-demo}"
shift || true
case "$job" in
    demo)
        exec "$VENV/bin/comlrl" demo "$@"
        ;;
    test)
        set +e
        "$VENV/bin/python" -m pytest "$@"
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
