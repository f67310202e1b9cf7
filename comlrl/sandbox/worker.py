"""A warm worker: one long-lived interpreter inside a slot's sandbox that runs that slot's programs one at a time
(run inside the sandbox; the trainer never imports it).

``python -I -S worker.py MODULE ...`` imports the modules named (those the programs will import anyway), then
reads jobs from its standard input: a length-prefixed ``marshal`` of ``(source, stdin_length, limits,
timeout, max_output)`` from the trainer, then ``stdin_length`` bytes of the program's input. It answers
each on its standard output with chunks of the program's output, ``O N`` or ``E N`` (stdout, stderr) each
followed by N bytes, then ``S STATUS TIMED_OUT TRUNCATED`` (``STATUS`` the exit status, ``128 + N`` for
signal N as a fresh sandbox reports it, ``-`` when the worker killed it), plain text the trainer parses
without ``marshal``. The program's input and output move between pipes in the kernel (``splice``) and never
enter the worker's memory, which every later program is forked from.

Each program is a fresh child of the worker (``fork``): a new session, the kernel's limits set before its
first line, its own scratch directory ``/sandbox/run`` as its working directory, its own pipes for its
three streams. When it ends (or at its deadline, or when its output passes the cap) every other process
in the sandbox is killed, double-forked and ``setsid`` ones included (``kill(-1)``, repeated until only the
worker is left: it is the namespace's PID 1, so orphans come back to it), everything the program wrote is
removed (``/sandbox`` and ``/dev/shm``), and System V IPC objects it made are deleted. So programs of one
slot never overlap and nothing of one is left for the next. The worker cannot be read or traced by them
(not dumpable), nor killed from inside (the kernel ignores signals a namespace's PID 1 did not ask for);
one that stops it anyway ends the slot, which the trainer then starts anew.
"""

import marshal
import os
import resource
import select
import signal
import sys
import time

HEADER = 12
SCRATCH = "/sandbox"
RUN = "/sandbox/run"
CODE_CACHE = {}  # source -> compiled code: the same harness text is compiled once per worker


def read_exactly(count):
    chunks, left = [], count
    while left:
        chunk = os.read(0, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive():
    header = read_exactly(HEADER)
    if header is None:
        return None
    return marshal.loads(read_exactly(int(header)))


def exit_status(raw):
    """The program's exit status, a death by signal N as ``128 + N`` (as the trainer's other path reports it)."""
    code = os.waitstatus_to_exitcode(raw)
    return 128 - code if code < 0 else code


def send(answer):
    """The job's last line, ``S STATUS TIMED_OUT TRUNCATED``: plain text the trainer parses itself."""
    status, timed_out, truncated = answer
    data = b"S %s %d %d\n" % (b"-" if status is None else b"%d" % status, timed_out, truncated)
    while data:
        data = data[os.write(1, data):]


def libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def run_child(code, stdin_read, out_write, err_write, limits):
    """In the forked child: become the program (never returns)."""
    try:
        os.setsid()
        for fd, target in ((stdin_read, 0), (out_write, 1), (err_write, 2)):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(RUN)
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, name), (value, value))
        sys.argv = ["main.py"]
        sys.stdin = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        status = 0
        try:
            exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
        except SystemExit as ended:
            code_given = ended.code
            if code_given is None:
                status = 0
            elif isinstance(code_given, int):
                status = code_given & 0xFF
            else:
                print(code_given, file=sys.stderr)
                status = 1
        except BaseException:
            sys.__excepthook__(*sys.exc_info())
            status = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(status)
    except BaseException:
        os._exit(1)


def others_left():
    me = os.getpid()
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != me]


KILL_DEADLINE = 20.0  # seconds: on a loaded machine a fork bomb's processes take long to die and be reaped


def kill_all():
    """Kill every process in the sandbox but the worker (its PID 1), and reap them: repeated until none is left,
    by a deadline in time rather than a count of rounds (a count ran out on a machine at load 10, leaving a fork
    bomb's processes for the next program). Past the deadline the worker exits and the trainer starts a new slot."""
    deadline, pause = time.monotonic() + KILL_DEADLINE, 0.001
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        if not others_left():
            return
        if time.monotonic() > deadline:
            os._exit(70)  # never serve the next program beside a survivor
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wipe(path, keep_root=True):
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            os.chmod(full, 0o700)
            wipe(full, keep_root=False)
        else:
            os.unlink(full)
    if not keep_root:
        os.rmdir(path)


def remove_ipc(c):
    for kind, remover in (("shm", c.shmctl), ("msg", c.msgctl), ("sem", c.semctl)):
        try:
            with open(f"/proc/sysvipc/{kind}") as table:
                rows = table.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 1:
                if kind == "sem":
                    remover(int(fields[1]), 0, 0)  # IPC_RMID
                else:
                    remover(int(fields[1]), 0, None)


def clean(c):
    kill_all()
    for place in (SCRATCH, "/dev/shm"):
        if os.path.isdir(place):
            wipe(place)
    remove_ipc(c)


def compiled(source):
    code = CODE_CACHE.get(source)
    if code is None:
        code = compile(source, "main.py", "exec", dont_inherit=True)
        if len(CODE_CACHE) < 8:
            CODE_CACHE[source] = code
    return code


def emit(tag, relay, count):
    """Pass ``count`` bytes from the ``relay`` pipe to the trainer behind a ``TAG COUNT`` line, in the kernel."""
    data = b"%s %d\n" % (tag, count)
    while data:
        data = data[os.write(1, data):]
    while count:
        count -= os.splice(relay, 1, count)


def run_job(job, c):
    """Run one program; its input and output pass through the kernel (``splice``), never through this
    process's memory, so what one program read or wrote is not in the memory the next one is forked from."""
    source, stdin_length, limits, timeout, cap = job
    try:
        code = compiled(source)
    except (SyntaxError, ValueError) as error:
        drain(stdin_length)
        message = f"SyntaxError: {error}\n".encode()
        os.write(1, b"E %d\n" % len(message) + message)
        return (1, False, False)
    os.mkdir(RUN, 0o700)
    stdin_read, stdin_write = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        run_child(code, stdin_read, out_write, err_write, limits)
    for fd in (stdin_read, out_write, err_write):
        os.close(fd)
    relay_read, relay_write = os.pipe()
    deadline = time.monotonic() + timeout
    tags = {out_read: b"O", err_read: b"E"}
    sent = {out_read: 0, err_read: 0}
    reading = set(tags)
    pending = stdin_length
    writing = set()
    if pending:
        os.set_blocking(stdin_write, False)
        writing.add(stdin_write)
    else:
        os.close(stdin_write)
    timed_out = truncated = False
    status = None
    while reading and not (timed_out or truncated):
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        readable, writable, _ = select.select(list(reading), list(writing), [], min(left, 0.005))
        if writable:
            try:
                pending -= os.splice(0, stdin_write, min(pending, 1 << 16))
            except BlockingIOError:
                pass
            except OSError:  # the program closed its input: the rest is not wanted
                drain(pending)
                pending = 0
            if not pending:
                os.close(stdin_write)
                writing.clear()
        if status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:  # the program ended: what it left running ends with it, as a PID namespace's init would
                status = exit_status(raw)
                kill_all()
        for fd in readable:
            room = cap - sent[fd]
            moved = os.splice(fd, relay_write, min(1 << 16, room + 1))
            if not moved:
                os.close(fd)
                reading.discard(fd)
                continue
            if moved > room:
                truncated = True
                drain_relay(relay_read, moved - room)  # the bytes past the cap are dropped
                moved = room
            if moved:
                emit(tags[fd], relay_read, moved)
            sent[fd] += moved
    if pending:
        drain(pending)
    if not (timed_out or truncated):
        while status is None:  # the streams are closed: wait for the program itself
            try:
                done, raw = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                status = exit_status(raw)
            elif time.monotonic() > deadline:
                timed_out = True
                break
            else:
                time.sleep(0.0005)
    for fd in reading | writing | {relay_read, relay_write}:
        os.close(fd)
    clean(c)
    return (None if timed_out or truncated else status, timed_out, truncated)


def drain(count):
    """Discard ``count`` bytes of the trainer's input (a program that did not read all of it)."""
    with open(os.devnull, "wb") as null:
        while count:
            count -= os.splice(0, null.fileno(), min(count, 1 << 16))


def drain_relay(relay, count):
    with open(os.devnull, "wb") as null:
        while count:
            count -= os.splice(relay, null.fileno(), count)


def main():
    c = libc()
    c.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: programs cannot read or trace the worker
    c.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back here to be reaped (it is PID 1 anyway)
    for name in sys.argv[1:]:
        try:
            __import__(name)
        except ImportError:
            pass
    clean(c)
    while True:
        job = receive()
        if job is None:
            return
        send(run_job(job, c))


main()
