"""What a person sees of a finished run in the two UIs, in a real browser (Debian's Chromium driven by Selenium).

One tiny run trains with ``comlrl run`` on the embedded default; then the UI commands it prints under "where to
look" are started as printed (on free loopback ports) and the browser opens the pages an operator would: the
Prefect flow run (its boundary subflows, its summary and table artifacts with the run's numbers) and the MLflow
run (the eval metric's value and curve) and registered team model (the aliases the gate gave). The expected
values come from the run's result.json and the MLflow client, never from this file.

Screenshots of the four pages are saved under the test's tmp directory; with ``COMLRL_UI_SCREENSHOTS=DIR``
they are copied there too (docs/img holds the ones docs/pipeline.md shows).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from flows.artifacts import artifact_key
from flows.boundaries import primary_eval
from letters_spec import letters_spec
from test_servers import ROOT, free_port, get_json

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

from browser import headless_chromium, kept_screenshots  # skips this module without a browser
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

RUN_ID = "ui-run"
EPOCHS = 2
SPEC = letters_spec("uitest", num_generations=2, max_new_tokens=6, temperature=1.0, agent_learning_rate=0.003,
                    num_train_epochs=EPOCHS, per_device_train_batch_size=2, eval_interval=2)  # an eval per epoch
PAGE_TIMEOUT = 60  # seconds for a single-page app to show a text (a busy 2-core machine)
SERVER_TIMEOUT = 150


# ----- the run and its two UI servers ---------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> dict:
    """``comlrl run`` of a two-epoch tiny spec on the embedded default; its result and printed UI commands."""
    project = tmp_path_factory.mktemp("project")
    write_dataset(project / "data" / "letters", num_train=4, num_eval=2)
    (project / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    workdir = tmp_path_factory.mktemp("work")
    env = {key: value for key, value in os.environ.items()
           if key not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    done = subprocess.run([str(Path(sys.executable).parent / "comlrl"), "run", str(project / "spec.yaml"),
                           "--root", str(project), "--workdir", str(workdir), "--run-id", RUN_ID],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    commands = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
                for line in done.stdout.split("where to look:", 1)[1].splitlines() if " UI:" in line}
    result = json.loads((workdir / "runs" / RUN_ID / "result.json").read_text())
    return {"workdir": workdir, "result": result, "commands": commands}


def split_command(line: str) -> tuple[dict[str, str], list[str]]:
    """A printed shell line as (its leading VAR=value assignments, argv)."""
    words = shlex.split(line)
    assignments = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        assignments[name] = value
    return assignments, words


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def server(name: str, argv: list[str], env: dict[str, str], health_url: str, log: Path) -> Iterator[None]:
    """``argv`` in a process group of its own until ``health_url`` answers; the whole group is stopped after."""
    with log.open("w") as output:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT, process_group=0)
    try:
        deadline = time.monotonic() + SERVER_TIMEOUT
        while not healthy(health_url):
            assert process.poll() is None and time.monotonic() < deadline, \
                f"the {name} UI server did not start ({' '.join(argv)}): {log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def uis(finished_run, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The Prefect and MLflow UIs the run printed, each on a free loopback port; their base URLs."""
    logs = tmp_path_factory.mktemp("ui-logs")
    base = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    prefect_port, mlflow_port = free_port(), free_port()
    assignments, prefect_argv = split_command(finished_run["commands"]["Prefect UI"])
    # The port as a setting, not --port: the UI page takes the API URL it calls from the settings (port 4200
    # otherwise), and from PREFECT_API_URL when that is set, hence none in the environment.
    prefect_env = {**base, **assignments, "PREFECT_SERVER_API_PORT": str(prefect_port),
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    mlflow_assignments, mlflow_argv = split_command(finished_run["commands"]["MLflow UI"])
    mlflow_argv += ["--port", str(mlflow_port), "--workers", "1"]  # one worker starts in seconds, not a minute
    prefect_url, mlflow_url = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(server("Prefect", prefect_argv, prefect_env, f"{prefect_url}/api/health",
                                   logs / "prefect.log"))
        stack.enter_context(server("MLflow", mlflow_argv, {**base, **mlflow_assignments}, f"{mlflow_url}/health",
                                   logs / "mlflow.log"))
        yield {"prefect": prefect_url, "mlflow": mlflow_url}


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Iterator[Path]:
    with kept_screenshots(tmp_path_factory.mktemp("screenshots"), "COMLRL_UI_SCREENSHOTS") as directory:
        yield directory


# ----- waiting on single-page apps ------------------------------------------------------------------
def page_text(driver) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def wait_for_text(driver, *texts: str, timeout: float = PAGE_TIMEOUT) -> str:
    """The page's text once it shows every one of ``texts``; fails naming the missing ones."""
    try:
        WebDriverWait(driver, timeout, poll_frequency=0.5).until(
            lambda d: all(text in page_text(d) for text in texts))
    except TimeoutException:
        shown = page_text(driver)
        missing = [text for text in texts if text not in shown]
        raise AssertionError(f"{driver.current_url} did not show {missing} within {timeout} s; it shows:\n"
                             f"{shown[:3000]}") from None
    return page_text(driver)


def click_text(driver, text: str, timeout: float = PAGE_TIMEOUT) -> None:
    """Click the innermost visible element whose text is ``text`` (a tab, a section header)."""
    locator = (By.XPATH, f"//*[normalize-space(.)='{text}']")  # ancestors come first in document order

    def innermost(d):
        return next((element for element in reversed(d.find_elements(*locator)) if element.is_displayed()), None)

    WebDriverWait(driver, timeout, poll_frequency=0.5).until(innermost).click()


def wait_for_element(driver, css: str, timeout: float = PAGE_TIMEOUT):
    """The first element ``css`` selects, once there is one."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5).until(
            lambda d: next(iter(d.find_elements(By.CSS_SELECTOR, css)), None))
    except TimeoutException:
        raise AssertionError(f"{driver.current_url} had no {css} within {timeout} s; it shows:\n"
                             f"{page_text(driver)[:3000]}") from None


def js_number(value: float) -> str:
    """How the browser writes a float: the shortest round-trip digits, as Python's repr for ordinary sizes."""
    assert 1e-6 <= abs(value) < 1e21, f"{value}: pick a metric JavaScript writes without an exponent"
    return repr(value).removesuffix(".0")


def save(driver, directory: Path, name: str) -> None:
    driver.execute_script("window.scrollTo(0, 0)")
    assert driver.save_screenshot(str(directory / name))


# ----- the Prefect UI ---------------------------------------------------------------------------------
def prefect_flow_run_id(uis) -> str:
    runs = get_json(f"{uis['prefect']}/api/flow_runs/filter",
                    {"flow_runs": {"name": {"any_": [RUN_ID]}, "parent_task_run_id": {"is_null_": True}}})
    assert len(runs) == 1, runs
    return runs[0]["id"]


def latest_artifact(uis, key: str) -> dict:
    found = get_json(f"{uis['prefect']}/api/artifacts/filter",
                     {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1})
    assert found, f"no Prefect artifact {key}"
    return found[0]


def test_the_prefect_flow_run_page_shows_the_boundary_subflows(uis, finished_run, browser, screenshots):
    boundaries = finished_run["result"]["boundaries"]
    assert len(boundaries) == EPOCHS
    browser.get(f"{uis['prefect']}/runs/flow-run/{prefect_flow_run_id(uis)}")
    wait_for_text(browser, RUN_ID, "Completed", "Subflow Runs")
    click_text(browser, "Subflow Runs")
    titles = [f"{row['boundary']} of {len(boundaries)}" for row in boundaries]  # flows.boundaries.title
    shown = wait_for_text(browser, *titles)
    assert shown.count("Completed") >= len(titles) + 1  # the run and each subflow
    save(browser, screenshots, "prefect-flow-run.png")


def test_the_prefect_artifacts_show_the_runs_numbers(uis, finished_run, browser, screenshots):
    result = finished_run["result"]
    browser.get(f"{uis['prefect']}/runs/flow-run/{prefect_flow_run_id(uis)}")
    wait_for_text(browser, RUN_ID, "Artifacts")
    click_text(browser, "Artifacts")
    wait_for_text(browser, artifact_key(RUN_ID, "summary"), artifact_key(RUN_ID, "gate"))

    # The boundaries' table: a version per boundary, made in its subflow; the latest has every boundary's row.
    table = artifact_key(RUN_ID, "boundaries")
    browser.get(f"{uis['prefect']}/artifacts/key/{table}")
    wait_for_text(browser, *[f"{row['boundary']} of {len(result['boundaries'])}" for row in result["boundaries"]])
    browser.get(f"{uis['prefect']}/artifacts/artifact/{latest_artifact(uis, table)['id']}")
    cells = [js_number(row[column]) for row in result["boundaries"] for column in ("reward", "eval_reward")]
    wait_for_text(browser, *[row["boundary"] for row in result["boundaries"]], *cells)

    # The summary: every boundary's numbers (4 decimals), the final evaluation and the gate's verdict.
    browser.get(f"{uis['prefect']}/artifacts/artifact/{latest_artifact(uis, artifact_key(RUN_ID, 'summary'))['id']}")
    metric, final = primary_eval(result["evaluation"])
    rows = [f"{row['boundary']} {row['step']} {row['reward']:.4f} {row['eval_reward']:.4f}"
            for row in result["boundaries"]]
    verdict = "promoted to champion" if result["gate"]["promoted"] else "not promoted"
    wait_for_text(browser, *rows, f"Final evaluation: {final:.4f} ({metric})",
                  f"Gate: {verdict} ({result['gate']['reason']})", f"{result['team']['name']} v{result['team']['version']}")
    save(browser, screenshots, "prefect-artifacts.png")


# ----- the MLflow UI ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tracking(finished_run):
    from mlflow import MlflowClient

    client = MlflowClient(finished_run["result"]["tracking_uri"])
    return client, client.get_run(finished_run["result"]["mlflow_run_id"])


def close_assistant(driver) -> None:
    """Close MLflow's assistant side panel (it covers a third of the page) where this version shows one."""
    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()
            return


def test_the_mlflow_run_page_shows_the_eval_metric_and_its_curve(uis, finished_run, tracking, browser, screenshots):
    client, run = tracking
    metric, _ = primary_eval(finished_run["result"]["evaluation"])  # what the gate judged the run by
    history = client.get_metric_history(run.info.run_id, metric)
    assert len(history) == EPOCHS  # an evaluation per epoch: the curve has a point per epoch
    page = f"{uis['mlflow']}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    browser.get(page)
    shown = wait_for_text(browser, RUN_ID, metric)
    assert re.search(rf"^{re.escape(metric)}\n{re.escape(js_number(run.data.metrics[metric]))}$", shown, re.M), \
        f"{metric} = {run.data.metrics[metric]} not in the run's metrics table:\n{shown[:3000]}"

    browser.get(f"{page}/model-metrics")
    wait_for_element(browser, "input[placeholder='Search metric charts']").send_keys(metric)
    wait_for_text(browser, f"{RUN_ID} ({metric})")  # the chart's legend: this run's curve of the metric
    points = wait_for_element(browser, ".js-plotly-plot").find_elements(By.CSS_SELECTOR, ".scatterlayer .points path")
    assert len(points) == len(history), f"the curve shows {len(points)} points, the run logged {len(history)}"
    close_assistant(browser)
    save(browser, screenshots, "mlflow-run.png")


def test_the_mlflow_model_page_shows_the_aliases_the_gate_gave(uis, finished_run, tracking, browser, screenshots):
    client, _ = tracking
    team = finished_run["result"]["team"]
    aliases = {alias for alias, version in client.get_registered_model(team["name"]).aliases.items()
               if str(version) == str(team["version"])}
    assert team["alias"] in aliases
    assert ("champion" in aliases) == finished_run["result"]["gate"]["promoted"]
    browser.get(f"{uis['mlflow']}/#/models/{team['name']}")
    wait_for_text(browser, team["name"], f"Version {team['version']}", *[f"@ {alias}" for alias in sorted(aliases)])
    close_assistant(browser)
    save(browser, screenshots, "mlflow-model.png")
