"""The embedded default's MLflow store: ``<workdir>/mlflow/mlflow.db``, named by a URI any workdir name survives,
and created whole or not at all (a first creation cut short by a full disk leaves nothing behind)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from urllib.parse import quote


def embedded_store(workdir: str | Path) -> Path:
    """The MLflow SQLite database of the embedded default: ``<workdir>/mlflow/mlflow.db``."""
    return Path(workdir).resolve() / "mlflow" / "mlflow.db"


def sqlite_uri(database: Path, scheme: str = "sqlite") -> str:
    """The SQLAlchemy URI (``scheme``: ``sqlite``, or ``sqlite+aiosqlite`` for Prefect's server) that MLflow and
    SQLAlchemy both resolve to exactly the file ``database`` (absolute).

    SQLAlchemy percent-decodes the database part and ends it at a ``?``, so a path holding ``%`` or ``?`` (or any
    not printable) cannot be written plainly. It becomes an SQLite ``file:`` URI (``uri=true``): SQLAlchemy decodes
    the URI's text once and hands SQLite the ``file:`` URI, which SQLite decodes into the path, byte for byte.

    Before opening it, MLflow makes the database's parent directory from the URI: earlier versions read its text as
    it stands, 3.18 as SQLAlchemy decodes it (``make_url(uri).database``). So every ``/`` stays encoded in both
    layers and neither reading names a directory: its parent is ``.``, which exists. (With the ``/`` decoded, 3.18
    read a relative ``file:/…`` path and made that tree under the current directory.) Only SQLite, decoding the
    ``file:`` URI, sees the path.
    """
    text = str(database)
    if "%" not in text and "?" not in text and text.isprintable():
        return f"{scheme}:///{text}"
    return f"{scheme}:///" + quote("file:" + quote(os.fsencode(database), safe=""), safe="") + "?uri=true"


def embedded_tracking_uri(workdir: str | Path) -> str:
    """The tracking URI of the embedded store under ``workdir`` (created or not)."""
    return sqlite_uri(embedded_store(workdir))


def workdir_uri_problem(workdir: str | Path) -> str | None:
    """Why MLflow cannot keep the embedded store's artifacts under ``workdir``, or None. Any name works for the
    store itself (:func:`sqlite_uri`), but MLflow finds artifacts by ``file:`` URIs that it decodes as UTF-8
    (``mlflow.utils.file_utils.local_file_uri_to_path``), so a path holding other bytes names another directory."""
    path = os.path.abspath(workdir)
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError as error:
        return (f"--workdir {path!r} holds the byte {error.object[error.start]:#04x}, which is not UTF-8, and MLflow "
                "would keep its artifacts in another directory: rename it, or choose another --workdir")
    return None


def default_tracking_uri(workdir: str | Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the SQLite store under ``workdir``, created if missing
    (:func:`ensure_embedded_store`)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and uri != embedded_tracking_uri(workdir):
        return uri
    ensure_embedded_store(workdir)
    return embedded_tracking_uri(workdir)


def ensure_embedded_store(workdir: str | Path) -> Path:
    """The embedded store's database, created with MLflow's whole schema if missing; a stat when it exists.

    MLflow creates a missing database in place with a series of migrations, and one cut short (a full disk)
    leaves a store no later run can open. So the schema is built in a temporary file beside it, which takes
    the store's name only when finished; of two processes creating it at once, the first to finish wins and
    the other uses its store. A failure leaves nothing behind and raises an ``OSError`` naming the store.
    """
    database = embedded_store(workdir)
    if database.exists():
        return database
    temporary = None
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f"{database.name}.", suffix=".creating", dir=database.parent)
        os.close(handle)
        temporary = Path(name)
        create_mlflow_schema(temporary, database.parent / "artifacts")
        publish_store(temporary, database)
    except Exception as error:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise OSError(f"could not create the MLflow store {database} ({cause}); nothing was left behind: if its "
                      "disk is full, free space there, then run the same command again") from error
    finally:
        if temporary is not None:  # SQLite's journal files are named after the database
            for leftover in ("", "-journal", "-wal", "-shm"):
                Path(f"{temporary}{leftover}").unlink(missing_ok=True)
    return database


def create_mlflow_schema(database: Path, artifact_root: Path) -> None:
    """MLflow's tracking and model-registry tables (its migrations, run to the head revision) and its default
    experiment, whose artifacts go under ``artifact_root``, in the SQLite file ``database``."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(sqlite_uri(database), artifact_root.as_uri())
    store.engine.dispose()  # no pooled connection keeps the temporary file open once it is published


def publish_store(temporary: Path, database: Path) -> None:
    """Give the finished store at ``temporary`` the name ``database``, unless another process did first."""
    try:
        os.link(temporary, database)  # atomic, and never replaces a store another process may be using
    except FileExistsError:
        return
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if not database.exists():  # a filesystem without hard links: rename, which would replace
            os.replace(temporary, database)
