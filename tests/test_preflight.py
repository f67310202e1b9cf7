"""Issue 38, "Refused before work": what a run needs outside its spec (data files, --workdir, the servers) is
checked before anything starts (flows/preflight.py). The command line cases are real ``comlrl run`` processes
on bad files written here; each process carries a few cases at once (one spec validation costs 7 s quiet, ~30 s
on a loaded 2-core machine), and every case must give its own ``comlrl:`` line. The rest calls the preflight's
functions on real files, directories and loopback servers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from flows import preflight as pf
from flows.spec import load_spec, parse_spec
from letters_spec import letters_spec
from loopback_http import LoopbackServer

REPOSITORY = Path(__file__).resolve().parent.parent
COMLRL = str(Path(sys.executable).parent / "comlrl")
# The whole refusal, spec validation (torch and the trainer classes imported) included; the preflight's own part
# is about a second, plus at most PROBE_SECONDS for a server that does not answer.
REFUSAL_SECONDS = 60
SMALL = dict(num_generations=2, max_new_tokens=4, num_train_epochs=1, per_device_train_batch_size=2)


# ---- bad files, as people make them --------------------------------------------------------------------------

def without_prompt(path: Path) -> None:
    pq.write_table(pa.table({"text": ["tell me about the cat"]}), path)


def no_rows(path: Path) -> None:
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)


def truncated(path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["tell me about the cat"] * 50}), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut short: no footer


def text_named_parquet(path: Path) -> None:
    path.write_text("prompt\ntell me about the cat\n")


def null_prompt(path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["tell me about the cat", "and the dog", None, "the sun"]}), path)


def integer_prompt(path: Path) -> None:
    pq.write_table(pa.table({"prompt": [7, 8]}), path)


def torn_line(path: Path) -> None:
    path.write_text('{"prompt": "tell me about the cat"}\n{"prompt": "and the d\n{"prompt": "the sun"}\n')


def zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


def project(tmp_path: Path, train: tuple | None = None, eval: tuple | None = None) -> tuple[Path, Path]:
    """A --root with the letters data and a valid spec whose train / eval files may be swapped for bad ones
    (``(file name, writer)``); the spec's path and the root."""
    root = tmp_path / "project"
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    spec = letters_spec("preflight", **SMALL)
    for split, bad in (("train", train), ("eval", eval)):
        if bad:
            name, write = bad
            write(root / "data" / name)
            spec["dataset"][split] = f"data/{name}"
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root / "spec.yaml", root


def comlrl_run(spec: Path, root: Path, workdir: Path, wrapper: list[str] = (), **env: str):
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    started = time.monotonic()
    result = subprocess.run([*wrapper, COMLRL, "run", str(spec), "--workdir", str(workdir), "--root", str(root)],
                            env={**clean, "HF_HUB_OFFLINE": "1", **env}, capture_output=True, text=True,
                            cwd=REPOSITORY, timeout=300)
    return result, time.monotonic() - started


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_refused(result, seconds: float, expected: list[list[str]]) -> None:
    """Exit 2 in time, only ``comlrl:`` lines and one per case, each naming what ``expected`` lists."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert seconds < REFUSAL_SECONDS, seconds
    assert "Traceback" not in result.stderr and not result.stdout.strip(), result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert all(line.startswith("comlrl: ") for line in lines), lines
    for fragments in expected:
        assert any(all(fragment in line for fragment in fragments) for line in lines), (fragments, lines)
    assert len(lines) == len(expected), lines


# ---- real processes ------------------------------------------------------------------------------------------

CLI_CASES = {
    "no prompt column, empty eval file, bad tracking and Prefect variables": dict(
        train=("no_prompt.parquet", without_prompt), eval=("empty_eval.jsonl", zero_bytes),
        env={"MLFLOW_TRACKING_URI": "htp://x", "PREFECT_API_URL": "not-a-url"},
        expected=[["dataset.train", "no_prompt.parquet", "no column 'prompt'", "['text']", "formatters"],
                  ["dataset.eval", "empty_eval.jsonl", "empty (0 bytes)"],
                  ["MLFLOW_TRACKING_URI='htp://x'", "scheme 'htp'"],
                  ["PREFECT_API_URL='not-a-url'", "not an http(s) URL"]]),
    "no rows, truncated Parquet, workdir below a file": dict(
        train=("no_rows.parquet", no_rows), eval=("cut.parquet", truncated), workdir_below_a_file=True,
        expected=[["dataset.train", "no_rows.parquet", "has no rows"],
                  ["dataset.eval", "cut.parquet", "not a readable Parquet file", "magic bytes"],
                  ["--workdir", "below", "is a file, not a directory"]]),
    "text named .parquet, null prompt, unreachable tracking server": dict(
        train=("words.parquet", text_named_parquet), eval=("null.parquet", null_prompt),
        env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:{port}"},
        expected=[["dataset.train", "words.parquet", "not a readable Parquet file"],
                  ["dataset.eval", "null.parquet", "row 2: 'prompt' is null"],
                  ["MLFLOW_TRACKING_URI='http://127.0.0.1:", "does not answer", "/health", "Connection refused"]]),
    "integer prompt, torn JSON line": dict(
        train=("numbers.parquet", integer_prompt), eval=("torn.jsonl", torn_line),
        expected=[["dataset.train", "numbers.parquet", "row 0: 'prompt' is 7", "int64"],
                  ["dataset.eval", "torn.jsonl", "line 2 is not valid JSON"]]),
}


@pytest.mark.e2e  # real comlrl processes, ~20 s each on a loaded machine: the end-to-end tier
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_comlrl_run_lists_every_problem_and_exits_2_before_anything_starts(case, tmp_path):
    settings = CLI_CASES[case]
    spec, root = project(tmp_path, settings.get("train"), settings.get("eval"))
    workdir = tmp_path / "work"
    if settings.get("workdir_below_a_file"):
        (tmp_path / "a-file").write_text("not a directory")
        workdir = tmp_path / "a-file" / "below"
    env = {key: value.format(port=free_port()) for key, value in settings.get("env", {}).items()}
    result, seconds = comlrl_run(spec, root, workdir, **env)
    expected = settings["expected"]
    assert_refused(result, seconds, expected)
    for fragments in expected:  # the files are named by their full path
        if fragments[0].startswith("dataset."):
            assert any(str(root / "data" / fragments[1]) in line for line in result.stderr.splitlines())
    # Nothing started: no working directory at all, so no MLflow store (mlflow/) and no PREFECT_HOME (prefect/).
    assert not workdir.exists() and not (tmp_path / "work").exists()


@pytest.mark.e2e  # real comlrl processes, ~20 s each on a loaded machine: the end-to-end tier
def test_a_read_only_workdir_is_refused_even_for_root(tmp_path):
    """chmod does not stop root, so the working directory is a read-only bind mount (EROFS) in a mount
    namespace of the comlrl process's own: real for root, gone when the process ends."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    spec, root = project(tmp_path)
    workdir = tmp_path / "read-only"
    workdir.mkdir()
    # 97: the mount was refused (no privilege here); 98: the bind mount is still writable (old mount(8)).
    script = ('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" || exit 97; '
              'touch "$0/probe" 2>/dev/null && exit 98; exec "$@"')
    namespace = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    result, seconds = comlrl_run(spec, root, workdir, wrapper=[*namespace, "sh", "-c", script, str(workdir)])
    if result.returncode in (97, 98) or "unshare:" in result.stderr:
        pytest.skip(f"no read-only bind mount here: {result.stderr.strip()[-200:]}")
    assert_refused(result, seconds, [["--workdir", str(workdir), "is not writable", "Read-only file system"]])
    assert list(workdir.iterdir()) == []


@pytest.mark.e2e  # real comlrl processes, ~20 s each on a loaded machine: the end-to-end tier
def test_comlrl_resume_is_refused_when_the_recorded_data_went_bad(tmp_path):
    """A run directory as `comlrl run` leaves it (its spec and root), whose eval file was cut since."""
    spec, root = project(tmp_path, eval=("eval.jsonl", torn_line))
    workdir = tmp_path / "work"
    run = workdir / "runs" / "preflight-1"
    run.mkdir(parents=True)
    shutil.copy(spec, run / "spec.yaml")
    (run / "root.txt").write_text(str(root))
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    started = time.monotonic()
    result = subprocess.run([COMLRL, "resume", "preflight-1", "--workdir", str(workdir)], env=clean,
                            capture_output=True, text=True, cwd=REPOSITORY, timeout=300)
    assert_refused(result, time.monotonic() - started, [["dataset.eval", str(root / "data" / "eval.jsonl"), "line 2"]])
    assert sorted(path.name for path in workdir.iterdir()) == ["runs"]  # no mlflow/, no prefect/


@pytest.mark.e2e
def test_a_valid_spec_passes_the_preflight_and_trains(tmp_path):
    spec, root = project(tmp_path)
    result, _ = comlrl_run(spec, root, tmp_path / "work")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stderr.splitlines() if line.startswith("comlrl: ")]
    assert (tmp_path / "work" / "mlflow" / "mlflow.db").is_file()


# ---- the preflight's functions ---------------------------------------------------------------------------------

def test_the_bundled_spec_and_its_data_pass(tmp_path, monkeypatch):
    for variable in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(variable, raising=False)
    spec = load_spec(REPOSITORY / "flows" / "specs" / "letters.yaml", REPOSITORY)
    assert pf.preflight(spec, str(tmp_path / "new" / "work"), REPOSITORY) == []
    assert not (tmp_path / "new").exists()  # a missing working directory is judged by its parent, not created


def spec_with(root: Path, **changes) -> object:
    data = {**letters_spec("preflight", **SMALL), **changes}
    return parse_spec(data, "spec.yaml", root)


def test_one_spec_with_several_problems_lists_them_all(tmp_path, monkeypatch):
    _, root = project(tmp_path, ("no_prompt.parquet", without_prompt), ("torn.jsonl", torn_line))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "htp://x")
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    spec = spec_with(root, dataset={"train": "data/no_prompt.parquet", "eval": "data/torn.jsonl"})
    problems = pf.preflight(spec, str(tmp_path / "a-file" / "below"), root)
    assert [problem.split(" ")[0] for problem in problems] == [
        "dataset.train", "dataset.eval", "--workdir", "MLFLOW_TRACKING_URI='htp://x'",
        f"PREFECT_API_URL='{os.environ['PREFECT_API_URL']}'"], problems
    assert "no column 'prompt'" in problems[0] and "line 2 is not valid JSON" in problems[1]


def test_without_a_spec_the_workdir_and_servers_are_still_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "not-a-url")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "a-file").write_text("")
    problems = pf.preflight(None, str(tmp_path / "a-file"), tmp_path)
    assert len(problems) == 2 and "is a file, not a directory" in problems[0] and "PREFECT_API_URL" in problems[1]


def test_a_run_started_from_another_spec_or_trained_elsewhere_is_named(tmp_path, monkeypatch):
    """The run's recorded hash (as prepare_run writes it for a new run) and its lock, held here by a real flock."""
    from comlrl.checkpointing.lock import DirectoryLock
    from flows.runs import prepare_run
    from flows.spec import spec_hash

    for variable in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(variable, raising=False)
    spec_file, root = project(tmp_path)
    spec, workdir = spec_with(root), tmp_path / "work"
    assert pf.preflight(spec, str(workdir), root, "r1") == []  # no such run yet: nothing to compare
    run = prepare_run(spec, spec_file, "r1", workdir, root)
    assert pf.preflight(spec, str(workdir), root, "r1") == []  # its own spec
    edited = spec_with(root, name="preflight-edited")
    lock = DirectoryLock(run.directory, "flow.lock", shared=False).acquire()  # unshared: a holder of its own
    try:
        problems = pf.preflight(edited, str(workdir), root, "r1")
        assert pf.preflight(edited, str(workdir), root, None) == []  # no run id: the run is not looked at
    finally:
        lock.release()
    assert len(problems) == 2, problems
    assert (f"run 'r1' was started from another spec (hash {spec_hash(spec)[:10]}; this one "
            f"{spec_hash(edited)[:10]}") in problems[0] and str(run.spec_copy) in problems[0]
    assert "'r1' is being trained by another process" in problems[1] and str(run.directory / "flow.lock") in problems[1]
    assert pf.preflight(spec, str(workdir), root, "r1") == []  # released: free again, and nothing was left locked


def test_with_formatters_only_rows_and_form_are_checked(tmp_path):
    _, root = project(tmp_path, ("no_prompt.parquet", without_prompt), ("empty.parquet", no_rows))
    spec = spec_with(root, dataset={"train": "data/no_prompt.parquet", "eval": "data/empty.parquet"},
                     formatters="comlrl.tasks.letters:letters_reward")  # any allowed callable: only its presence counts
    problems = pf.dataset_problems(spec, root)
    assert len(problems) == 1 and problems[0].startswith("dataset.eval") and "has no rows" in problems[0]


def test_hub_datasets_and_entry_points_are_no_files_and_are_skipped(tmp_path):
    _, root = project(tmp_path)
    spec = spec_with(root, dataset={"train": {"name": "someone/prompts"}, "eval": None})
    assert pf.dataset_problems(spec, root) == []


@pytest.mark.parametrize("name, content, expected", [
    ("rows.json", '[{"prompt": "a"}, {"prompt": 3}]', "element 1, row 1: 'prompt' is 3 (int), not text"),
    ("rows.json", '[{"prompt": "a"},', "not valid JSON at line 1, column 18"),
    ("rows.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n', "line 3, row 1: 'prompt' is null"),
    ("rows.jsonl", '{"text": "a"}\n', "no column 'prompt' (in no row)"),
    ("rows.jsonl", '["a"]\n{"prompt": 1\n{"prompt": 2\n', "line 1 is a JSON list, not an object (and 2 more such)"),
    ("rows.json", '\n  \n', "has no rows: a dataset needs"),
    ("rows.json", ' []', "has no rows: a dataset needs"),
    ("rows.jsonl", b'{"prompt": "\xff"}\n', "line 1 is not UTF-8 text"),
], ids=["array int", "array torn", "missing key", "no column", "not objects", "blank", "empty array", "not utf-8"])
def test_json_files_name_the_line_and_row(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    problems = pf.file_problems(path, needs_prompt=True)
    assert len(problems) == 1 and expected in problems[0], problems


def test_good_json_files_pass(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b", "extra": 1}')  # no final newline
    (tmp_path / "rows.json").write_text('[{"prompt": "a"}]')
    assert pf.file_problems(tmp_path / "rows.jsonl", True) == pf.file_problems(tmp_path / "rows.json", True) == []


@pytest.mark.parametrize("statistics", [True, False], ids=["statistics", "no statistics"])
def test_a_null_prompt_in_a_later_row_group_is_named_by_its_row(tmp_path, statistics):
    prompts = ["p"] * 200_000
    prompts[150_001] = None
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": prompts}), path, row_group_size=50_000, write_statistics=statistics)
    assert pf.file_problems(path, True) == [
        "row 150001: 'prompt' is null: every row needs a text prompt; fix or drop the row"]
    prompts[150_001] = "p"
    pq.write_table(pa.table({"prompt": pa.array(prompts).dictionary_encode()}), path, write_statistics=statistics)
    assert pf.file_problems(path, True) == []


def test_a_missing_workdir_is_fine_and_is_not_created(tmp_path):
    assert pf.workdir_problems(str(tmp_path / "a" / "b"), needed_bytes=1) == []
    assert list(tmp_path.iterdir()) == []  # the probe file is gone too


def test_a_workdir_without_room_for_a_checkpoint_is_named(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    problems = pf.workdir_problems(str(tmp_path), needed_bytes=free + 10 * pf.GIB)
    assert len(problems) == 1 and problems[0].startswith(f"--workdir {str(tmp_path)!r} has ")
    assert "GiB free; one checkpoint" in problems[0] and "choose another --workdir" in problems[0]


def test_a_checkpoint_is_estimated_from_the_model_files(tmp_path, tiny_llama):
    _, root = project(tmp_path)
    local = root / "models" / "agent"
    shutil.copytree(tiny_llama, local)
    size = sum(path.stat().st_size for path in local.rglob("*") if path.is_file())
    assert pf.checkpoint_bytes(spec_with(root, models={"agent_model": "./models/agent"}), root) == 2 * size
    tiny = letters_spec("preflight", **SMALL)["models"]
    assert pf.checkpoint_bytes(spec_with(root, models=tiny), root) == 2 * pf.TINY_MODEL_BYTES
    registry = {"agents": ["models:/team-agent-0/1", "./models/agent"]}
    assert pf.checkpoint_bytes(spec_with(root, models=registry), root) == pf.MINIMUM_MODEL_BYTES + size


@pytest.mark.parametrize("uri", ["sqlite:///runs/mlflow.db", "postgresql+psycopg2://u:p@db:5432/mlflow",
                                 "file:///tmp/mlruns", "/tmp/mlruns", "databricks"])
def test_tracking_uris_mlflow_takes_are_accepted_without_a_request(uri):
    assert pf.tracking_uri_problem(uri) is None
    assert pf.service_problems({"MLFLOW_TRACKING_URI": uri}) == []


@pytest.mark.parametrize("uri, expected", [("htp://x", "scheme 'htp'"), ("http://", "names no host"),
                                           ("http://h:port", "port that is not a number")])
def test_malformed_tracking_uris_are_named(uri, expected):
    problems = pf.service_problems({"MLFLOW_TRACKING_URI": uri})
    assert len(problems) == 1 and problems[0].startswith(f"MLFLOW_TRACKING_URI={uri!r} ") and expected in problems[0]


class Health(LoopbackServer):
    """Answers GET /v1/health (and nothing else) with ``status``; remembers the requests' paths and logins."""

    def __init__(self, status: int) -> None:
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append((self.path, self.headers.get("Authorization")))
                self.send_response(status if self.path == "/v1/health" else 404)
                self.end_headers()
                self.wfile.write(b"true")

            def log_message(self, *args) -> None:
                pass

        self.serve(Handler)


@pytest.mark.parametrize("status, mlflow_ok, prefect_ok", [(200, True, True), (401, True, True), (404, True, False),
                                                            (503, False, False)])
def test_servers_are_asked_for_their_health(status, mlflow_ok, prefect_ok):
    server = Health(status)
    try:
        problems = pf.service_problems({"MLFLOW_TRACKING_URI": server.url, "PREFECT_API_URL": server.url + "/"})
    finally:
        server.close()
    assert [path for path, _ in server.requests] == ["/v1/health", "/v1/health"]
    assert any(p.startswith("MLFLOW_TRACKING_URI") for p in problems) is not mlflow_ok, problems
    assert any(p.startswith("PREFECT_API_URL") for p in problems) is not prefect_ok, problems
    assert all(f"with HTTP {status}" in problem for problem in problems)
    if status == 404:
        assert "ending in /api?" in problems[0]


def test_a_login_in_the_url_is_sent_and_never_shown():
    server = Health(503)
    try:
        url = server.url.replace("http://", "http://alice:s3cret@")
        problems = pf.service_problems({"PREFECT_API_URL": url})
    finally:
        server.close()
    assert server.requests == [("/v1/health", "Basic YWxpY2U6czNjcmV0")]  # base64 of alice:s3cret
    assert len(problems) == 1 and "s3cret" not in problems[0] and "alice:***@127.0.0.1" in problems[0]


def test_a_server_that_never_answers_costs_the_probe_bound(monkeypatch):
    monkeypatch.setattr(pf, "PROBE_SECONDS", 0.5)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        started = time.monotonic()
        problems = pf.service_problems({"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}",
                                        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
    assert time.monotonic() - started < 3
    assert len(problems) == 2 and all("does not answer" in p and "timed out" in p for p in problems), problems
