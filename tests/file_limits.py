"""The process's file-size limit (``ulimit -f``) for tests of a full disk, put back on leaving."""
import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(limit: int | None = None):
    """Files of this process may hold only ``limit`` bytes (``None``: as they are now, for a callback that sets the
    limit in the middle of a run). A write past the limit fails with EFBIG (SIGXFSZ ignored) instead of killing the
    test process; on leaving, the limit and the SIGXFSZ handler are what they were on entering."""
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)
