"""Where the command line's runs live and report: the embedded default's settings and servers, and the
closing "where to look" lines. Call :func:`configure` before Prefect is imported."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from comlrl.executables import executable


def configure(workdir: str, orchestrate: bool = True) -> None:
    """The embedded default's settings; with ``orchestrate`` and no ``PREFECT_API_URL``, its Prefect server
    (:mod:`flows.embedded`, in a process group of its own). Call before Prefect is imported."""
    from flows.orchestrator import bound_client_waits
    from flows.runs import configure_embedded_default

    configure_embedded_default(workdir)
    bound_client_waits()  # before Prefect is imported: it reads its settings then
    if orchestrate and not os.environ.get("PREFECT_API_URL"):
        from flows import embedded

        embedded.start(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")))


def where_to_look(workdir: str) -> None:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    print("\nwhere to look:")
    if uri.startswith("sqlite:"):
        artifacts = Path(workdir).resolve() / "mlflow" / "artifacts"
        print(f"  MLflow UI:   {executable('mlflow')} ui --backend-store-uri {shlex.quote(uri)} "
              f"--default-artifact-root {shlex.quote(str(artifacts))} --host 127.0.0.1")
    else:
        print(f"  MLflow:      {uri}")
    if os.environ.get("PREFECT_API_URL") and not os.environ.get("COMLRL_EMBEDDED_PREFECT"):
        print(f"  Prefect:     {os.environ['PREFECT_API_URL'].removesuffix('/api')}")
    else:
        print(f"  Prefect UI:  PREFECT_HOME={os.environ.get('PREFECT_HOME')} {executable('prefect')} server start "
              "--host 127.0.0.1")
        print("               (the embedded default keeps its flow-run history there)")
