"""Which rank stopped answering: heartbeats in the job's rendezvous store (host backend).

Each rank runs a daemon thread that bumps its heartbeat key every ``BEAT_S`` and watches
every other rank's: a rank whose heartbeat has not moved for ``timeout_s`` (stopped,
hung in the kernel, unreachable) or whose process is gone (same host: ``/proc``) is named
on this rank's last line, ``DECODE FAILED: rank N ...``, and the process exits with 2
right away (``os._exit``: a survivor may sit in a gloo collective that never returns).
``arrive`` waits in the store, not in gloo, until every rank reached a point of the job,
so a slow but live rank (rank 0 checking a step) never trips the gloo timeout.
A collective that raises, or SIGTERM from the launcher, shortens the heartbeat limit to
``SUSPECT_S`` to name the rank that died before reporting.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

BEAT_S = 0.5  # heartbeat period
SUSPECT_S = 3.0  # heartbeat limit after a collective failed or the launcher said stop
PREFIX = "decode/live/"


def hard_exit(code: int, tick_s: float | None = None, ticks: int = 1) -> None:
    """``os._exit(code)``, at the ``ticks``-th next multiple of ``tick_s`` on the clock when
    given (ranks leaving together; SIGTERM meanwhile exits with ``code`` at once), after
    flushing stdio and, when coverage measures this process (the test suite's subprocess
    measurement), saving its data first, which ``os._exit`` would drop with the ``atexit``
    hooks."""
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    measuring = current() if current is not None else None
    if measuring is not None:
        try:
            measuring.stop()
            measuring.save()
        except Exception:  # measurement must never change how the process exits
            pass
    if tick_s:  # a rank that reached this wait just after a tick is stopped by the launcher
        # (SIGTERM) when the others leave: it leaves with ``code`` too
        signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        time.sleep(tick_s * ticks - time.time() % tick_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _proc_gone(pid: int) -> bool:
    """The process ``pid`` (this host) exited: no /proc entry, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


class Liveness:
    """Heartbeats of ``world`` ranks through ``store`` / ``beat_store`` (two clients of one
    TCP store: the main thread's and the heartbeat thread's)."""

    def __init__(self, rank, world, timeout_s, store, beat_store, *, store_on_rank0=False):
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.store, self.beat_store, self.store_on_rank0 = store, beat_store, store_on_rank0
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._limit = self.timeout_s
        self._last_tag = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        store.set(f"{PREFIX}beat/{rank}", "0")
        store.set(f"{PREFIX}proc/{rank}", f"{self.pid} {self.host}")
        self._keys = [f"{PREFIX}beat/{r}" for r in range(world)]
        procs = [f"{PREFIX}proc/{r}" for r in range(world)]
        try:
            store.wait(procs)  # the store client's timeout: timeout_s
        except Exception:
            missing = [r for r, k in enumerate(procs) if not store.check([k])]
            self.report(missing[0] if missing else None, "never joined the job's liveness watch")
        self.procs = {}
        for r in range(world):
            pid, host = store.get(f"{PREFIX}proc/{r}").decode().split(" ", 1)
            self.procs[r] = (int(pid), host)
        self._thread = threading.Thread(target=self._watch, name="liveness", daemon=True)
        self._thread.start()
        signal.signal(signal.SIGTERM, self._terminated)

    # --- the main thread ----------------------------------------------------------------
    def arrive(self, tag) -> None:
        """Wait until every rank called ``arrive(tag)`` (store polling; the heartbeat
        thread ends the process if a rank stops answering meanwhile)."""
        self.store.set(f"{PREFIX}at/{tag}/{self.rank}", "1")
        keys = [f"{PREFIX}at/{tag}/{r}" for r in range(self.world)]
        pause = 0.0005
        while not self.store.check(keys):
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        if self._last_tag is not None:  # every rank is past that wait: drop this rank's key
            self.store.delete_key(f"{PREFIX}at/{self._last_tag}/{self.rank}")
        self._last_tag = tag

    def failed(self, error: BaseException) -> None:
        """A collective raised: name the rank that stopped (or report ``error``); exits."""
        self._limit = min(self._limit, SUSPECT_S)
        self._thread.join(self._limit + 2 * BEAT_S + 1.0)
        text = str(error).strip()
        first = text.splitlines()[0][:200] if text else ""
        if not isinstance(error, RuntimeError):  # not a collective's error: show where
            traceback.print_exception(error)
        self.report(None, f"{type(error).__name__}: {first} (no rank was seen to stop)")

    def done(self) -> None:
        """This rank is through its last collective: others stop watching it."""
        self.store.set(f"{PREFIX}done/{self.rank}", "1")
        self._stop.set()
        self._thread.join()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def report(self, rank, why) -> None:
        """Print the last line (once per process) and exit with status 2."""
        with self._lock:
            who = "" if rank is None else f"rank {rank} "
            print(f"DECODE FAILED: {who}{why} (seen by rank {self.rank})", flush=True)
            hard_exit(2)

    def _terminated(self, signum, frame):
        self._limit = min(self._limit, SUSPECT_S)
        self._thread.join(self._limit + 2 * BEAT_S + 1.0)
        self.report(None, "stopped by the launcher (SIGTERM) and no rank was seen to stop")

    # --- the heartbeat thread -----------------------------------------------------------
    def _watch(self) -> None:
        seen = {r: (None, time.monotonic()) for r in range(self.world) if r != self.rank}
        beat = 0
        while not self._stop.wait(BEAT_S):
            beat += 1
            try:
                self.beat_store.set(self._keys[self.rank], str(beat))
                values = self.beat_store.multi_get(self._keys)
            except Exception as e:  # the store is gone: its host died
                if self._stop.is_set():
                    return
                where = "rank 0 (hosts the rendezvous store)" if self.store_on_rank0 else None
                self.report(0 if where else None, f"unreachable: the rendezvous store failed ({e})")
            now = time.monotonic()
            for r in seen:
                value = values[r]
                if value != seen[r][0]:
                    seen[r] = (value, now)
                    continue
                pid, host = self.procs[r]
                gone = host == self.host and _proc_gone(pid)
                quiet = now - seen[r][1]
                if (gone or quiet > self._limit) and not self._finished(r):
                    if gone:
                        why = f"exited (pid {pid} is gone)"
                    else:
                        why = f"stopped answering: no heartbeat for {quiet:.1f} s"
                        why += f" (pid {pid} on {host})"
                    self.report(r, why + f"; --timeout {self.timeout_s:g} s")

    def _finished(self, rank) -> bool:
        try:
            return self.beat_store.check([f"{PREFIX}done/{rank}"])
        except Exception:
            return False
