"""Runs a function in a forked child of a process that imported TensorFlow.

The test scripts that train in processes of their own (`resume/restarts.py`,
`small_memory/child.py`) import TensorFlow, Keras and keras_accum once and
fork a child per run: each child starts with the modules imported, without
paying for the imports again.
"""

import os
import sys
import traceback

from tensorflow.python.eager import context


def fork(function, stderr_path):
    """Calls `function()` in a forked child; returns the child's pid.

    The child's stderr goes to `stderr_path`; it exits with 0, with the
    code of a `SystemExit` that `function` raised, or with 1 (the
    traceback in its stderr) if it raised another exception. Forking is safe
    only before TensorFlow's runtime (and its threads) started: no
    TensorFlow op may have run in this process.
    """
    assert context.context()._context_handle is None, "TensorFlow started"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        with open(stderr_path, "w") as stderr:
            os.dup2(stderr.fileno(), 2)
        function()
    except SystemExit as exit:  # `sys.exit(code)`: that status
        code = exit.code if isinstance(exit.code, int) else int(
            exit.code is not None
        )
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid):
    """Waits for child `pid`; returns its exit code (negative: the signal
    that ended it)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
