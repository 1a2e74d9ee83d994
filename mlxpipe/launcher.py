"""Keeping ``mlx.launch``'s own process from taking the ranks' CPU.

mlx.launch (mlx 0.32) relays each rank's stdin, stdout and stderr with a thread that ``select``s on the rank's
stdin pipe for writing: a pipe with room is always writable, so the thread never sleeps; its main loop spins
too when its own stdin is at end of file (``< /dev/null``, cron, CI). Together about a core of the launching
host, taken from the ranks computing there (bench/RESULTS.md). A rank never reads stdin (mlxpipe
refuses stdin input under mlx.launch), so it fills its stdin pipe, which then stops being writable and the
relay thread sleeps in ``select``; and it lowers the launcher's priority, which leaves its main loop only
idle cores. Linux only (``/proc``); elsewhere, and for ranks on other hosts (their stdin is ssh's terminal),
nothing changes. ``MLXPIPE_CALM_LAUNCHER=off`` leaves the launcher alone (to measure the difference).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys

from .switches import turned_off

__all__ = ["ENV", "calm"]

ENV = "MLXPIPE_CALM_LAUNCHER"

_PIPE_FILL = 1 << 16  # bytes written at a time until the pipe is full (Linux pipes hold 64 KiB by default)
_LAUNCHER_NICE = 19
_MAX_DEPTH = 4  # parents looked at: mlx.launch runs the rank through bash's exec, or a wrapper or two


def calm() -> list[str]:
    """On a rank of a local mlx.launch job: fill this process's stdin pipe and lower the launcher's priority.

    Returns what was done, for ``--model-info``-style reports; never raises.
    """
    if sys.platform != "linux" or turned_off(ENV):
        return []
    done = []
    if _fill_stdin():
        done.append("stdin pipe filled")
    launcher = _launcher_pid()
    if launcher is not None and _renice(launcher):
        done.append(f"launcher {launcher} at nice {_LAUNCHER_NICE}")
    return done


def _fill_stdin() -> bool:
    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return False
        # The same pipe, opened again for writing (Linux lets /proc/self/fd reopen a pipe either way).
        fd = os.open("/proc/self/fd/0", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        while os.write(fd, bytes(_PIPE_FILL)):
            pass
    except BlockingIOError:
        return True  # full: the relay thread's select now waits
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _launcher_pid() -> int | None:
    pid = os.getppid()
    for _ in range(_MAX_DEPTH):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if any(arg.endswith((b"mlx.launch", b"_distributed_utils/launch.py")) for arg in argv[:3]):
            return pid
        if parent <= 1:
            return None
        pid = parent
    return None


def _renice(pid: int) -> bool:
    # Linux priorities are per thread: each of the launcher's threads, its relay threads included.
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    changed = False
    for tid in threads:
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(tid), _LAUNCHER_NICE)
            changed = True
    return changed
