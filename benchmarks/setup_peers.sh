#!/usr/bin/env bash
# Create benchmarks/.venv-peers with the comparison targets: the reference `comlrl` from PyPI
# and TRL. It is separate from the project's .venv on purpose: both packages import as
# `comlrl`, and neither peer is a dependency of this library.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-peers"
python="${PYTHON:-python3}"
reference_version="${COMLRL_REFERENCE_VERSION:-1.4.3}"
trl_version="${TRL_VERSION:-1.16.0}"
torch_version="${TORCH_VERSION:-2.13.0}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# torch first, pinned, so the resolver keeps the local CPU build instead of pulling CUDA wheels.
"$venv/bin/pip" install -q "torch==$torch_version"
# scipy too: the project's .venv has it (via mlflow), and transformers imports it whenever it is
# installed (~40 MiB resident), so without it the peers would look lighter for a reason outside the code.
"$venv/bin/pip" install -q "comlrl==$reference_version" "trl==$trl_version" psutil scipy
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "comlrl", "trl"):
    print(f"{name}=={md.version(name)}")
PY
