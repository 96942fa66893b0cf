"""Ending an rpcps process once its role has returned, without the interpreter's slow teardown.

By the time a role's ``run`` returns, it has done everything its end needs: the server stopped,
wrote its final snapshot and summary, left the RPC group; a worker left and wrote its summary. What
the interpreter would still do is clear every module of torch's import graph object by object:
measured 1-2 s of CPU per process on a 2-core machine (a stopped server took 2.0 s from SIGTERM to
exit, 0.15 s of it its own shutdown), paid by every stop, every finished worker and everything that
waits for one. ``exit_now`` keeps what that teardown is for (non-daemon threads finish, ``atexit``
handlers run, log handlers and stdio are flushed) and skips the rest.

Only for the command line's own process (``trainer_entry``): code that calls ``cli.main.main`` in
process (tests) gets its return code back as before.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Ends the process with ``code`` after what the interpreter's exit must do, without freeing every object.

    Files a role left open lose nothing: rpcps's long-lived ones (the audit log) are line-buffered,
    every other file is written and closed where it is made.
    """
    # In the interpreter's own order: threading's exit hooks (they end idle thread-pool workers), then
    # a wait for every non-daemon thread, then atexit handlers. threading._shutdown is what
    # Py_FinalizeEx itself calls first; joining threads by hand would wait forever for pool workers
    # that only that hook tells to end.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it anyway
            pass
    os._exit(code)
