"""The preflight of ``comlrl run``/``resume``: what a run needs from outside its spec, checked before anything starts.

The spec is validated by :mod:`flows.spec`; this module looks at what the spec points to and at the place the run
will live: the dataset files (well-formed, not empty, a text ``prompt`` in every row when no formatters are
given), the working directory (can be created, is writable, has room for a checkpoint), the run the run id names
(started from this spec, its directory writable, not trained by another process right now, its MLflow run still in
MLflow) and the stores and servers named by ``MLFLOW_TRACKING_URI`` / ``PREFECT_API_URL`` (well-formed, a local store
that can be created, a server answering). :func:`preflight` returns every problem as one line naming the file,
column, row, directory or variable and the fix; it starts no server, opens no MLflow run and loads no model, so a
refused run costs seconds and leaves nothing behind (docs/pipeline.md, "The preflight").
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Mapping

from comlrl.executables import executable
from flows.runs import RunLock, RunPaths
from flows.tracking_store import embedded_tracking_uri, workdir_uri_problem
from flows.spec import DatasetSource, RunSpec, TinySource, data_path, model_path_or_id, spec_hash

PROMPT = "prompt"  # the column comlrl.data.default_formatter reads when a spec names no formatters
GIB = 1 << 30
MINIMUM_MODEL_BYTES = GIB  # a model whose files are not on disk yet (a hub id, a models:/ URI): at least this
TINY_MODEL_BYTES = 16 << 20  # a {tiny: ...} model (the demo's are ~0.3 MB), with room to spare
JSON_CHECKED_BYTES = 128 << 20  # of a JSON file; what lies beyond is checked when the run loads it
PARQUET_BATCH_ROWS = 65_536
PROBE_SECONDS = 5.0  # each server gets one GET this long
TRACKING_SCHEMES = {"http", "https", "file", "databricks", "databricks-uc", "uc"}
DATABASE_SCHEMES = {"postgresql", "mysql", "sqlite", "mssql"}  # each also as <scheme>+<driver>
TRACKING_FIX = "or unset it to use the embedded store under --workdir"
PREFECT_FIX = "or unset it to use the embedded default (a Prefect server the command starts itself)"


def preflight(spec: RunSpec | None, workdir: str, root: str | Path, run_id: str | None = None,
              new_mlflow_run: bool = False) -> list[str]:
    """Every problem the run would meet outside its spec, one line each (empty: go). Without a ``spec`` (it was
    refused) the working directory and the servers are still checked, so one refusal lists everything.
    ``run_id`` is checked against the run it names when that run exists (None: not checked); with
    ``new_mlflow_run`` (``comlrl resume --new-mlflow-run``) its MLflow run is not looked for: it is replaced."""
    problems = dataset_problems(spec, Path(root)) if spec is not None else []
    problems += workdir_problems(workdir, checkpoint_bytes(spec, Path(root)) if spec is not None else 0)
    services = service_problems(os.environ)
    if spec is not None and run_id:  # its MLflow run is asked for only where the store's URI itself is fine
        ask = not new_mlflow_run and not any(line.startswith("MLFLOW_TRACKING_URI=") for line in services)
        problems += run_problems(spec, run_id, workdir, ask_mlflow=ask)
    return problems + services


# ---- datasets ---------------------------------------------------------------------------------------------------

def dataset_problems(spec: RunSpec, root: Path) -> list[str]:
    """Problems of the spec's dataset files (``name:`` and ``entry_point:`` sources are no files: not looked at)."""
    problems = []
    needs_prompt = spec.formatters is None
    for split in ("train", "eval"):
        source = getattr(spec.dataset, split)
        source = DatasetSource(path=source) if isinstance(source, str) else source
        if source is None or not source.path:
            continue
        try:
            path = data_path(source.path, root)
        except ValueError as error:
            problems.append(f"dataset.{split}: {error}")
            continue
        problems += [f"dataset.{split} {path}: {problem}" for problem in file_problems(path, needs_prompt)]
    return problems


def file_problems(path: Path, needs_prompt: bool) -> list[str]:
    """Why ``path`` (Parquet, JSON Lines or a JSON array) cannot feed a run: unreadable, empty, malformed, or
    (``needs_prompt``) a row without a text prompt."""
    try:
        if os.stat(path).st_size == 0:
            return ["the file is empty (0 bytes): a dataset needs at least one row"]
        with open(path, "rb"):
            pass
    except OSError as error:
        return [f"cannot be read ({error.strerror or error}): fix its permissions or the path"]
    if path.suffix == ".parquet":
        return parquet_problems(path, needs_prompt)
    return json_problems(path, needs_prompt)


def parquet_problems(path: Path, needs_prompt: bool) -> list[str]:
    """From the footer: well-formed, rows, columns; the prompt column's pages only when its statistics do not
    rule out nulls, or its type is not text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as error:
        return [f"not a readable Parquet file ({str(error).splitlines()[0]}): a truncated copy or another format "
                "named .parquet; write the file again"]
    if parquet.metadata.num_rows == 0:
        return ["has no rows: a dataset needs at least one"]
    if not needs_prompt:
        return []
    schema = parquet.schema_arrow
    if PROMPT not in schema.names:
        return [missing_prompt_column(schema.names)]
    kind = schema.field(PROMPT).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    textual = pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"
    if textual and not may_hold_nulls(parquet):
        return []
    start = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[PROMPT]):
            values = batch.column(0)
            if not textual:
                return [prompt_problem(0, values[0].as_py(), f"the column holds {kind}")]
            index = values.is_null().index(True).as_py()
            if index >= 0:
                return [prompt_problem(start + index, None)]
            start += len(values)
    except (pa.ArrowException, OSError, ValueError) as error:
        return [f"column {PROMPT!r} cannot be read after row {start} ({str(error).splitlines()[0]}): the file is "
                "damaged; write it again"]
    return []


def may_hold_nulls(parquet: Any) -> bool:
    """Whether the prompt column's statistics leave room for a null (no statistics: yes)."""
    metadata = parquet.metadata
    leaves = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
    if PROMPT not in leaves:
        return True
    column = leaves.index(PROMPT)
    for group in range(metadata.num_row_groups):
        statistics = metadata.row_group(group).column(column).statistics
        if statistics is None or not statistics.has_null_count or statistics.null_count:
            return True
    return False


def json_problems(path: Path, needs_prompt: bool) -> list[str]:
    """A ``.json`` file holding one array of objects, or JSON Lines (``.jsonl``, and a ``.json`` that does not
    start with ``[``), parsed line by line; at most the first JSON_CHECKED_BYTES are read."""
    with open(path, "rb") as handle:
        head = handle.read(JSON_CHECKED_BYTES + 1)
    if path.suffix == ".json" and head.lstrip().startswith(b"["):
        if len(head) > JSON_CHECKED_BYTES:
            return []  # too big to parse here as one document: checked at load time
        try:
            rows = json.loads(head.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            where = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
            return [f"not valid JSON{where} ({getattr(error, 'msg', error)}): repair the file or write it again"]
        return rows_problems(((index, f"element {index}", row) for index, row in enumerate(rows)), needs_prompt)
    return rows_problems(json_lines(head[:JSON_CHECKED_BYTES]), needs_prompt)


def json_lines(data: bytes):
    """``(row, "line N", value)`` for each non-blank line; ``value`` is a :class:`ValueError` for a line that is
    not JSON. A last line cut off by the byte bound is left out."""
    lines = data.split(b"\n")
    if len(data) == JSON_CHECKED_BYTES:
        lines = lines[:-1]
    row = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            value = ValueError(f"not UTF-8 text ({error.reason} at byte {error.start})")
        except json.JSONDecodeError as error:
            value = ValueError(f"not valid JSON ({error.msg}, column {error.colno}): a torn or cut-off line")
        yield row, f"line {number}", value
        row += 1


def rows_problems(rows, needs_prompt: bool) -> list[str]:
    """The first malformed row (and how many more), a missing prompt column, the first row without a text
    prompt, or no rows at all."""
    malformed: list[str] = []
    count, has_prompt, bad_prompt = 0, False, None
    for row, where, value in rows:
        count += 1
        if isinstance(value, ValueError) or not isinstance(value, dict):
            why = value if isinstance(value, ValueError) else f"a JSON {type(value).__name__}, not an object"
            malformed.append(f"{where} is {why}")
            continue
        has_prompt = has_prompt or PROMPT in value
        if needs_prompt and bad_prompt is None and not isinstance(value.get(PROMPT), str):
            bad_prompt = f"{where}, " + prompt_problem(row, value.get(PROMPT))
    if malformed:
        more = f" (and {len(malformed) - 1} more such)" if len(malformed) > 1 else ""
        return [f"{malformed[0]}{more}: repair or remove it"]
    if count == 0:
        return ["has no rows: a dataset needs at least one"]
    if needs_prompt and not has_prompt:
        return [missing_prompt_column(None)]
    return [bad_prompt] if needs_prompt and bad_prompt else []


def missing_prompt_column(columns: list[str] | None) -> str:
    seen = f" (columns: {columns})" if columns is not None else " (in no row)"
    return (f"no column {PROMPT!r}{seen}: without formatters each row's prompt is read from it: add the column, "
            "or name formatters in the spec")


def prompt_problem(row: int, value: Any, why: str = "") -> str:
    what = "null" if value is None else f"{value!r:.40} ({why or type(value).__name__}), not text"
    return f"row {row}: {PROMPT!r} is {what}: every row needs a text prompt; fix or drop the row"


# ---- the working directory --------------------------------------------------------------------------------------

def checkpoint_bytes(spec: RunSpec, root: Path) -> int:
    """About one checkpoint's weights: the size of each agent's and critic's model files when they are a local
    directory, TINY_MODEL_BYTES for a tiny model, MINIMUM_MODEL_BYTES for one not on disk yet."""
    copies = spec.trainer_config.num_agents
    total = 0
    for key, value in spec.models.items():
        sources = value if isinstance(value, list) else [value] * (copies if key == "agent_model" else 1)
        for source in sources:
            if isinstance(source, TinySource):
                total += TINY_MODEL_BYTES
                continue
            location = model_path_or_id(source, root)
            directory = Path(location)
            total += directory_bytes(directory) if directory.is_dir() else MINIMUM_MODEL_BYTES
    return total


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def workdir_problems(workdir: str, needed_bytes: int) -> list[str]:
    """Whether ``workdir`` exists or can be created, takes a file, and has ``needed_bytes`` free. Nothing is left
    behind: a missing directory is not created, its nearest existing parent is tried instead."""
    path = Path(os.path.abspath(workdir))
    existing = nearest_existing(path)
    name = f"--workdir {str(path)!r}"
    if (unnamable := workdir_uri_problem(path)) is not None:
        return [unnamable]
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be created: {str(existing)!r} is a file"
        return [f"{name} {where}, not a directory: choose another --workdir"]
    if (error := refuses_a_file(existing)) is not None:
        holder = "" if existing == path else f" (its nearest existing parent {str(existing)!r})"
        return [f"{name}{holder} is not writable ({error.strerror or error}): fix its permissions or mount, or "
                "choose another --workdir"]
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        return [f"{name} has {free / GIB:.2f} GiB free; one checkpoint of this spec's models needs about "
                f"{needed_bytes / GIB:.2f} GiB: free space there or choose another --workdir"]
    return []


def refuses_a_file(directory: Path) -> OSError | None:
    """Why ``directory`` does not take a new file (a read-only mount, permissions, a file system like /proc), or
    None: a temporary file is created there and removed."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".comlrl-preflight-", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return error
    return None


def nearest_existing(path: Path) -> Path:
    """``path``, or the nearest of its parents that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# ---- the run's own directory ------------------------------------------------------------------------------------

def run_problems(spec: RunSpec, run_id: str, workdir: str, ask_mlflow: bool = True) -> list[str]:
    """An existing run ``run_id`` that this spec cannot continue: started from another spec (its ``spec.sha256``),
    a directory it cannot write in, trained right now by another process (it holds ``flow.lock``), or (``ask_mlflow``)
    an MLflow run that is gone (:func:`mlflow_run_problems`). A run that does not exist yet has none."""
    run = RunPaths(run_id, Path(os.path.abspath(workdir)))
    if not run.directory.is_dir():
        return []
    problems = []
    stamp = run.directory / "spec.sha256"
    if stamp.is_file():
        started, given = stamp.read_text().strip(), spec_hash(spec)
        if started != given:
            problems.append(f"run {run_id!r} was started from another spec (hash {started[:10]}; this one "
                            f"{given[:10]}, so the spec or its copy {str(run.spec_copy)!r} was edited): undo the edit, "
                            "or give this spec a new --run-id")
    unwritable = run_directory_problem(run)
    if unwritable is not None:
        problems.append(unwritable)
    elif (run.directory / "flow.lock").is_file():
        lock = RunLock(run)
        try:
            free = lock.acquire()
        except OSError as error:  # the lock file itself cannot be opened (its permissions)
            problems.append(f"run {run_id!r} cannot be locked: {str(lock.path)!r} cannot be opened "
                            f"({error.strerror or error}): fix its permissions, then run the same command again")
        else:
            if free:
                lock.release()
            else:
                problems.append(f"run {run_id!r} is being trained by another process (it holds {str(lock.path)!r}): "
                                "wait for it to end, or give this run another --run-id")
    if ask_mlflow:
        problems += mlflow_run_problems(run, spec.name, os.environ)
    return problems


def run_directory_problem(run: RunPaths) -> str | None:
    """Why the run cannot write where a resume writes (its directory: the lock, ``boundaries.jsonl``; its
    checkpoints; its tracking spools), or None."""
    for directory in (run.directory, run.checkpoints, run.directory / "tracking"):
        if directory.is_dir() and (error := refuses_a_file(directory)) is not None:
            return (f"run {run.run_id!r} cannot be written: {str(directory)!r} is not writable "
                    f"({error.strerror or error}), and a resume writes its lock, checkpoints and records there: fix "
                    "its permissions or mount, then run the same command again")
    return None


def mlflow_run_problems(run: RunPaths, experiment: str, environ: Mapping[str, str]) -> list[str]:
    """The MLflow run that the run's newest checkpoint logs to, when MLflow no longer has it (deleted, or its store
    gone): a resume could not log there (each of its records refused, then the run failed), so the line offers to
    continue in a new MLflow run of the same experiment (``comlrl resume --new-mlflow-run``)."""
    from flows import new_mlflow_run

    try:
        checkpoint, recorded = new_mlflow_run.newest_identity(run)
    except Exception:  # a damaged checkpoint: restoring it names what is wrong
        return []
    mlflow_run_id = new_mlflow_run.logs_to(run, recorded)
    if checkpoint is None or mlflow_run_id is None:
        return []
    uri = environ.get("MLFLOW_TRACKING_URI", "").strip() or embedded_tracking_uri(run.workdir)
    store = local_store(uri)
    if store is not None and not store.exists():
        deleted, why = False, f"its MLflow store {str(store)!r} is gone"
    else:
        gone = mlflow_run_gone(uri, mlflow_run_id)
        if gone is None:
            return []
        deleted, why = gone
    recorded_at = recorded.get("tracking_uri")
    if recorded_at and recorded_at != uri:
        why += f" (the run logged to {redacted(recorded_at)}: to resume there, set MLFLOW_TRACKING_URI to it)"
    named = (f"{checkpoint.name} names it" if mlflow_run_id == recorded["run_id"] else
             f"it replaced {recorded['run_id']}, which {checkpoint.name} names")
    resume = f"{executable('comlrl')} resume {run.run_id} --workdir {shlex.quote(str(run.workdir))}"
    line = (f"run {run.run_id!r} logs to MLflow run {mlflow_run_id} ({named}), but {why}: continue it in a new "
            f"MLflow run of experiment {experiment!r}, which gets the metrics so far from the run's records and the "
            f"tag {new_mlflow_run.PREVIOUS_TAG}={mlflow_run_id}, with:  {resume} --new-mlflow-run")
    if deleted:  # the environment's MLFLOW_TRACKING_URI (a password in it stays unprinted), else the embedded store's
        store_uri = "" if environ.get("MLFLOW_TRACKING_URI", "").strip() else f"MLFLOW_TRACKING_URI={shlex.quote(uri)} "
        line += (f"; or restore the deleted run with:  {store_uri}{executable('mlflow')} runs restore --run-id "
                 f"{mlflow_run_id}  and then:  {resume}")
    return [line]


def mlflow_run_gone(uri: str, mlflow_run_id: str) -> tuple[bool, str] | None:
    """Whether MLflow at ``uri`` deleted run ``mlflow_run_id`` (True) or has no such run (False), and the words for
    it; None when it is there, or MLflow did not answer within twice PROBE_SECONDS (the run then meets that itself)."""
    from comlrl import tracking
    from comlrl.tracking_spool import mlflow_client

    tracking.bound_http_retries()
    try:
        found = tracking.call_with_deadline(lambda: mlflow_client(uri).get_run(mlflow_run_id), f"MLflow at {uri}",
                                            seconds=2 * PROBE_SECONDS)
    except Exception as error:
        if getattr(error, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            return False, f"MLflow at {redacted(uri)} has no such run"
        return None
    if found.info.lifecycle_stage == "deleted":
        return True, f"it was deleted in MLflow at {redacted(uri)}"
    return None


# ---- the servers ------------------------------------------------------------------------------------------------

def service_problems(environ: Mapping[str, str]) -> list[str]:
    """MLFLOW_TRACKING_URI and PREFECT_API_URL, when set: well-formed, and an http(s) server answering within
    PROBE_SECONDS (both asked at once). Unset, the embedded default is used and nothing is checked here."""
    problems, probes = [], []
    uri = environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        problem = tracking_uri_problem(uri)
        if problem:
            problems.append(problem)
        elif urllib.parse.urlsplit(uri).scheme.lower() in ("http", "https"):
            probes.append(("MLFLOW_TRACKING_URI", uri, False, TRACKING_FIX))
    url = environ.get("PREFECT_API_URL", "").strip()
    if url:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            problems.append(f"PREFECT_API_URL={redacted(url)!r} is not an http(s) URL: set it to the Prefect server's "
                            f"API URL (e.g. http://127.0.0.1:4200/api), {PREFECT_FIX}")
        else:
            probes.append(("PREFECT_API_URL", url, True, PREFECT_FIX))
    answers: dict[str, str | None] = {}

    def ask(variable: str, address: str, prefect: bool) -> None:
        answers[variable] = unanswered(address, prefect)

    threads = [threading.Thread(target=ask, args=probe[:3], daemon=True) for probe in probes]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + PROBE_SECONDS + 1  # a name lookup that hangs is not bounded by the socket timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for variable, address, _, fix in probes:
        why = answers.get(variable, f"no answer within {PROBE_SECONDS:.0f} s")
        if why:
            problems.append(f"{variable}={redacted(address)!r} {why}: start the server (bash infra/servers.sh "
                            f"start), fix the variable, {fix}")
    return problems


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use ``uri``: a scheme it does not take, a bad port or host, or a local store (an SQLite
    database, a ``file:`` URI or a plain path: MLflow keeps a file store there) that cannot be opened or created."""
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme and scheme not in TRACKING_SCHEMES and scheme.split("+")[0] not in DATABASE_SCHEMES:
        return (f"MLFLOW_TRACKING_URI={redacted(uri)!r} has the scheme {scheme!r}, which MLflow does not know: use "
                f"http(s)://HOST:PORT for a tracking server, sqlite:///PATH, postgresql://..., file:///PATH, "
                f"{TRACKING_FIX}")
    try:
        parts.port
    except ValueError:
        return f"MLFLOW_TRACKING_URI={redacted(uri)!r} has a port that is not a number: fix it, {TRACKING_FIX}"
    if scheme in ("http", "https") and not parts.hostname:
        return f"MLFLOW_TRACKING_URI={redacted(uri)!r} names no host: use http(s)://HOST:PORT, {TRACKING_FIX}"
    store = local_store(uri)
    why = store_problem(store) if store is not None else None
    if why is not None:
        kind = "database" if scheme.startswith("sqlite") else "store"
        return (f"MLFLOW_TRACKING_URI={redacted(uri)!r}: its {kind} {str(store)!r} {why}: point it at a writable "
                f"place, {TRACKING_FIX}")
    return None


def local_store(uri: str) -> Path | None:
    """Where a local MLflow store lives: a SQLite URI's database file, a ``file:`` URI's or a plain path's directory
    (absolute); None for a server or another database, and for SQLite in memory."""
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    if scheme == "file":
        return Path(os.path.abspath(urllib.parse.unquote(urllib.parse.urlsplit(uri).path)))
    if not scheme:
        return Path(os.path.abspath(uri))
    if scheme.split("+")[0] != "sqlite":
        return None
    from sqlalchemy.engine.url import make_url

    try:
        url = make_url(uri)
    except Exception:  # SQLAlchemy's ArgumentError: MLflow meets the same when it starts
        return None
    database = url.database
    if not database or database == ":memory:" or database.startswith("file::memory:"):
        return None
    if url.query.get("uri") == "true" and database.startswith("file:"):  # an SQLite file: URI (flows.tracking_store)
        path = urllib.parse.urlsplit(database).path
        return Path(os.path.abspath(os.fsdecode(urllib.parse.unquote_to_bytes(path))))
    return Path(os.path.abspath(database))


def store_problem(store: Path) -> str | None:
    """Why a local store at ``store`` cannot be opened or created (its file or directory, or the nearest existing
    parent where MLflow would create it, does not take a file), or None."""
    if store.exists():
        directory = store if store.is_dir() else store.parent
        if (error := refuses_a_file(directory)) is not None:
            return f"is in {str(directory)!r}, which is not writable ({error.strerror or error})"
        return None
    existing = nearest_existing(store.parent)
    if not existing.is_dir():
        return f"cannot be created: {str(existing)!r} is a file, not a directory"
    if (error := refuses_a_file(existing)) is not None:
        return f"cannot be created: {str(existing)!r} does not take a file ({error.strerror or error})"
    return None


def unanswered(base: str, prefect: bool) -> str | None:
    """Why GET ``base``/health got no usable answer, or None. Any answer below 500 shows a server is there (a
    login it asks for is the run's business); from Prefect, a 404 means the URL is not its API's."""
    parts = urllib.parse.urlsplit(base.rstrip("/") + "/health")
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])))
    if parts.username is not None:  # urllib sends no user:password@ by itself
        login = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
    address = redacted(urllib.parse.urlunsplit(parts))
    try:
        with urllib.request.urlopen(request, timeout=PROBE_SECONDS) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (OSError, ValueError) as error:
        return f"does not answer (GET {address}: {getattr(error, 'reason', error)})"
    if status >= 500 or (prefect and status == 404):
        hint = " (is it the API URL, ending in /api?)" if status == 404 else ""
        return f"answered GET {address} with HTTP {status}{hint}"
    return None


def redacted(uri: str) -> str:
    """``uri`` with a password in it replaced by ***, for messages."""
    parts = urllib.parse.urlsplit(uri)
    if not parts.password:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
