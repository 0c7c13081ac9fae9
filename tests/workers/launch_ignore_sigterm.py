"""Worker for the launcher's tests: ignore SIGTERM and sleep, so only SIGKILL ends it.

Runs as ``torchrun --nproc_per_node=2 tests/workers/launch_ignore_sigterm.py``
(it never ends by itself; stop it with SIGKILL).
"""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
time.sleep(3600)
