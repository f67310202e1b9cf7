"""First code inside the sandbox (never imported by the trainer): set the kernel's limits, then run the job.

``python -I -S prelude.py NAME=VALUE ...`` sets each ``resource`` limit NAME (soft = hard) to VALUE, then
runs the job's program, ``/job/main.py`` (or the folder in ``COMLRL_SANDBOX_JOB`` under
``isolation="rlimits"``), as ``__main__`` under its own file name, so its tracebacks and ``sys.exit``
behave as under ``python main.py``. It imports only builtin modules: each import here is paid by every
program.
"""

import os
import resource
import sys


def main():
    for setting in sys.argv[1:]:
        name, _, value = setting.partition("=")
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))
    path = os.path.join(os.environ.pop("COMLRL_SANDBOX_JOB", "/job"), "main.py")
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    sys.argv = [path]
    code = compile(source, path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})


main()
