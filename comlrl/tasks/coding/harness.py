"""The test harness that runs *inside* the sandbox (read as text and run there; the trainer never imports it).

Two processes, so that the code under test never shares memory with the tests:

* the **judge** (this file's ``main``) holds the problem's tests and runs them; it never runs the
  candidate's code. Its ``candidate`` is a proxy: each call sends the arguments to the server and waits.
* the **server** (``serve``) runs the candidate program and answers calls of its entry function with the
  returned value. It is forked before the judge reads the tests, so their text and expected values are
  not in its memory; a server restarted after a hang or a crash is a fresh interpreter (fork, then exec of
  :data:`BOOT`), which reads this file's text and the program from the judge.

Arguments go to the server with ``marshal`` (the judge's own data). Answers come back in a small typed
text format that only the builtin data types can take (``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, ``complex``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``; exact types, no
subclasses), read by :func:`decode`, which builds nothing else: an object whose ``==`` always says yes
cannot cross, so it can never satisfy an assertion. The judge is made non-dumpable, so the server cannot
read its memory or file descriptors through ``/proc``.

The judge writes one line per test statement to its standard output, ``test K 1`` (passed) or
``test K 0 HEX`` (failed, the reason as hex of UTF-8), then ``done``. The server cannot write there (its
standard streams are ``/dev/null``). A caller counts only the tests recorded as passed: a judge that was
killed or timed out credits nothing after the last line it wrote.

Input on standard input: two length-prefixed ``marshal`` parts, ``{"program", "entry_point",
"call_timeout", "imports", "harness"}`` (read before the server starts; ``harness`` is this file's text, which a
restarted server runs; ``imports`` are the problem's own modules,
imported once before the fork so that neither process pays for ``typing`` twice), then ``{"preamble", "module", "statements"}`` with
each statement a ``(source, is_test)`` pair. Only builtin modules are imported: the harness runs once
per program, and an import of ``json`` or ``re`` would cost more than the tests.
"""

import marshal
import math
import os
import select
import sys
import time

HEADER = 12  # bytes of a length prefix: a zero-padded decimal count
MAX_MESSAGE = 16 << 20
CONTAINERS = {list: "l", tuple: "t", set: "S", frozenset: "Z"}
BUILDERS = {"l": list, "t": tuple, "S": set, "Z": frozenset}


class CandidateError(Exception):
    """The candidate raised, returned something that cannot cross, hung, or ended."""


class Untransferable(Exception):
    pass


def encode(value, out, depth=0):
    """Append ``value``'s typed text to the list ``out``: builtin data types only, exact types."""
    if depth > 100:
        raise Untransferable("nested too deeply")
    kind = type(value)
    if value is None:
        out.append("N")
    elif kind is bool:
        out.append("T" if value else "F")
    elif kind is int:
        out.append(f"i{value};")
    elif kind is float:
        out.append(f"f{value!r};")
    elif kind is str:
        out.append(f"s{len(value)}:{value}")
    elif kind is bytes:
        out.append(f"b{value.hex()};")
    elif kind is complex:
        out.append(f"c{value.real!r};{value.imag!r};")
    elif kind is dict:
        out.append(f"d{len(value)}:")
        for key, item in value.items():
            encode(key, out, depth + 1)
            encode(item, out, depth + 1)
    elif kind in CONTAINERS:
        out.append(f"{CONTAINERS[kind]}{len(value)}:")
        for item in value:
            encode(item, out, depth + 1)
    else:
        raise Untransferable(f"a value of type {kind.__name__} cannot be checked (only builtin data types)")


def decode(text):
    """The value ``encode`` wrote; ValueError (or TypeError for an unhashable key) on anything else."""
    value, end = _decode(text, 0, 0)
    if end != len(text):
        raise ValueError("trailing data")
    return value


def _until(text, start, mark):
    end = text.index(mark, start)
    return text[start:end], end + 1


def _decode(text, at, depth):
    if depth > 100:
        raise ValueError("nested too deeply")
    tag, at = text[at], at + 1
    if tag == "N":
        return None, at
    if tag in "TF":
        return tag == "T", at
    if tag == "i":
        digits, at = _until(text, at, ";")
        return int(digits), at
    if tag == "f":
        digits, at = _until(text, at, ";")
        return float(digits), at
    if tag == "c":
        real, at = _until(text, at, ";")
        imag, at = _until(text, at, ";")
        return complex(float(real), float(imag)), at
    if tag == "b":
        digits, at = _until(text, at, ";")
        return bytes.fromhex(digits), at
    count, at = _until(text, at, ":")
    count = int(count)
    if count < 0:
        raise ValueError("negative length")
    if tag == "s":
        if at + count > len(text):
            raise ValueError("short string")
        return text[at:at + count], at + count
    items = []
    for _ in range(count * 2 if tag == "d" else count):
        item, at = _decode(text, at, depth + 1)
        items.append(item)
    if tag == "d":
        return dict(zip(items[::2], items[1::2])), at
    if tag in BUILDERS:
        return BUILDERS[tag](items), at
    raise ValueError("unknown tag")


def send(fd, data):
    data = b"%0*d" % (HEADER, len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd, deadline=None):
    """One length-prefixed message (bytes) from ``fd``; None at end of file; TimeoutError past ``deadline`` s."""
    header = read_exactly(fd, HEADER, deadline)
    if header is None:
        return None
    if not header.isdigit() or int(header) > MAX_MESSAGE:
        raise CandidateError("sent a malformed message")
    return read_exactly(fd, int(header), deadline)


def read_exactly(fd, count, deadline=None):
    chunks, left = [], count
    end = None if deadline is None else time.monotonic() + deadline
    while left:
        if end is not None:
            wait = end - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def described(error):
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text[:300]


# ----------------------------------------------------------------------------------------------- server
def serve(requests, replies, program, entry_point):
    """Run ``program``, then answer calls of ``entry_point`` until the judge closes the pipe."""
    problem = None
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(program, "solution.py", "exec"), namespace)
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: the program may raise anything
        problem = f"the program failed while loading: {described(error)}"
    while True:
        request = receive(requests)
        if request is None:
            os._exit(0)
        call, args = marshal.loads(request)
        out = [f"{call} "]
        try:
            if problem is not None:
                raise CandidateError(problem)
            function = namespace.get(entry_point)
            if not callable(function):
                raise CandidateError(f"the program defines no function {entry_point}")
            encode(function(*args), out)
            out[0] += "V"
        except BaseException as error:
            out = [f"{call} E{described(error)}"]
        send(replies, "".join(out).encode("utf-8", "surrogatepass"))


def become_server(requests, replies, program, entry_point):
    """In a fresh child: no way back to the judge's streams, then serve."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = sorted({requests, replies})
    os.closerange(3, keep[0])
    for low, high in zip(keep, keep[1:] + [1 << 16]):
        os.closerange(low + 1, high)
    serve(requests, replies, program, entry_point)


# A restarted server's interpreter starts from this, then reads the harness's text and its program from the judge.
BOOT = """import marshal, os, sys
requests, replies = int(sys.argv[1]), int(sys.argv[2])
def read(count):
    data = b""
    while len(data) < count:
        chunk = os.read(requests, count - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data
job = marshal.loads(read(int(read(12))))
harness = {"__name__": "harness", "__builtins__": __builtins__}
exec(compile(job["harness"], "harness.py", "exec"), harness)
harness["become_server"](requests, replies, job["program"], job["entry_point"])
"""


# ------------------------------------------------------------------------------------------------ judge
class Server:
    """The judge's side of the server: start, call, restart after a hang or a crash."""

    def __init__(self, program, entry_point, call_timeout, harness):
        self.program, self.entry_point, self.call_timeout = program, entry_point, call_timeout
        self.harness = harness  # this file's text, for a restarted server (the judge may have no file to point at)
        self.pid = None
        self.calls = 0

    def start(self, fresh):
        to_server, from_judge = os.pipe()
        to_judge, from_server = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(from_judge)
            os.close(to_judge)
            if fresh:
                os.set_inheritable(to_server, True)
                os.set_inheritable(from_server, True)
                os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", BOOT, str(to_server), str(from_server)])
            become_server(to_server, from_server, self.program, self.entry_point)
        os.close(to_server)
        os.close(from_server)
        self.pid, self.requests, self.replies = pid, from_judge, to_judge
        if fresh:
            send(self.requests, marshal.dumps({"harness": self.harness, "program": self.program,
                                               "entry_point": self.entry_point}))

    def stop(self):
        if self.pid is None:
            return
        for fd in (self.requests, self.replies):
            os.close(fd)
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        self.pid = None

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise CandidateError("keyword arguments are not supported by the harness")
        if self.pid is None:
            self.start(fresh=True)
        self.calls += 1
        prefix = f"{self.calls} "
        try:
            send(self.requests, marshal.dumps((self.calls, args)))
            while True:  # answers to earlier calls (sent ahead by the program) are skipped
                reply = receive(self.replies, self.call_timeout)
                if reply is None:
                    self.stop()
                    raise CandidateError("the program ended instead of answering")
                reply = reply.decode("utf-8", "surrogatepass")
                if reply.startswith(prefix):
                    break
        except TimeoutError:
            self.stop()
            raise CandidateError(f"no answer within {self.call_timeout:g} s") from None
        except (OSError, ValueError, CandidateError) as error:
            self.stop()
            raise CandidateError(described(error)) from None
        body = reply[len(prefix):]
        if body[:1] == "E":
            raise CandidateError(body[1:301])
        try:
            if body[:1] != "V":
                raise ValueError("no value")
            return decode(body[1:])
        except (ValueError, TypeError, IndexError, RecursionError, OverflowError):
            raise CandidateError("answered with a malformed value") from None


def not_dumpable():
    """Keep the server (same uid) out of the judge's memory and file descriptors (/proc/<pid>/mem, fd)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def record(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    not_dumpable()
    job = marshal.loads(receive(0))
    for name in job["imports"]:  # the problem's own imports, once, before the fork: the server inherits them
        try:
            __import__(name)
        except ImportError:
            pass
    server = Server(job["program"], job["entry_point"], float(job["call_timeout"]), job["harness"])
    server.start(fresh=False)  # forked before the tests are read: they never reach its memory
    checks = marshal.loads(receive(0))
    namespace = {"__name__": "check", "__builtins__": __builtins__}
    exec(compile(checks["preamble"], "problem.py", "exec"), namespace)
    exec(compile(checks["module"], "tests.py", "exec"), namespace)
    namespace["candidate"] = namespace[job["entry_point"]] = server  # as check(entry_point) sees it
    for index, (source, is_test) in enumerate(checks["statements"]):
        code = compile(source, f"test_{index}.py", "exec")
        try:
            exec(code, namespace)
            passed, error = True, None
        except Exception as failure:
            passed, error = False, described(failure) if not isinstance(failure, AssertionError) else (
                "AssertionError" + (f": {failure}" if str(failure) else ""))[:300]
        if is_test:
            record(f"test {index} 1" if passed else f"test {index} 0 {error.encode('utf-8', 'replace').hex()}")
    server.stop()
    record("done")


if __name__ == "__main__":
    main()
