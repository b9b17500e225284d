"""A decode worker process: `python -m kvwake.store.decode_worker` (started by decode_procs.DecodeProcs).

Its own module, imported by nothing: the store's package imports decode_procs, which would then be
imported once as itself and once more as __main__.
"""

from __future__ import annotations

import os
import signal
import sys

from kvwake.store.decode_procs import serve

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the caller's: a worker ends with its pipe
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints goes to stderr, never into the replies
    serve(sys.stdin.buffer, replies)
