"""The load generator's claim on a core, and how long it waited for one.

On a small host the servers under test and the load generator share the cores. At 128 streams both servers keep
the two cores of these hosts busy (engine compute, the engine's shared-memory spin, the serving path), and the
kernel's scheduler can leave the client runnable but waiting for 70-250 ms now and then. Every stream it reads
then shows one long gap at once, which is the client's wait, not the server's: measured in December 2026, the long
gaps that decided ITL p99 at 128 streams coincided with the client's event loop waiting on the run queue
(schedstat), while the server's event loop and the engine's output timestamps showed no gap (docs/serving-path.md
"The load generator's wait").

`prioritize()` gives the client precedence for the little CPU it needs (~15% of a core at 128 streams): its
scheduler autogroup (the kernel groups a session's processes and shares the CPU between groups, so a process's own
nice value only ranks it inside its group) and, where autogroups are off, the process itself. Both servers run in
their own sessions, so the same precedence holds against either. It needs root or CAP_SYS_NICE; where it is not
permitted the run goes on and the result says so. `waited_ms()` reads the calling thread's run-queue wait, so a
result records per round how long the client waited for a core.
"""

from __future__ import annotations

import atexit
import os

NICE = -10
AUTOGROUP = "/proc/self/autogroup"
SCHEDSTAT = "/proc/thread-self/schedstat"


def _autogroup_nice() -> int | None:
    try:
        with open(AUTOGROUP) as f:  # "/autogroup-7681 nice 0"
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup_nice(value: int) -> bool:
    try:
        with open(AUTOGROUP, "w") as f:
            f.write(str(value))
        return True
    except OSError:
        return False


def prioritize(nice: int = NICE) -> dict:
    """Raise this process's scheduling precedence over the servers' (call it after the servers have started, so
    they do not inherit it). Returns what was applied, for the result file. The autogroup's nice is shared by every
    process of the caller's session, so it is put back at exit."""
    applied: dict = {"nice": nice, "autogroup": False, "process": False}
    before = _autogroup_nice()
    if before is not None and _set_autogroup_nice(nice):
        applied["autogroup"] = True
        atexit.register(_set_autogroup_nice, before)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        applied["process"] = True
    except OSError:
        pass
    if not (applied["autogroup"] or applied["process"]):
        applied["note"] = "not permitted (needs root or CAP_SYS_NICE): the client competes for cores as the servers do"
    return applied


def waited_ms() -> float | None:
    """How long the calling thread has waited on a run queue, in total (ms), or None where the kernel does not
    say (no schedstat)."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, ValueError, IndexError):
        return None
