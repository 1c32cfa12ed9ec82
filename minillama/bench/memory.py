"""Peak resident memory of a run: the kernel's own high-water mark where it can be reset, else sampled."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

_STATUS, _CLEAR = "/proc/self/status", "/proc/self/clear_refs"


def _high_water_mark() -> int | None:
    """The process's peak resident memory in bytes (Linux's VmHWM), None where there is none."""
    try:
        with open(_STATUS) as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _reset_high_water_mark() -> bool:
    """Set the high-water mark back to the current resident memory (Linux 4.0+); False where it cannot."""
    try:
        with open(_CLEAR, "w") as f:
            f.write("5")
    except OSError:
        return False
    return _high_water_mark() is not None


class PeakRSS:
    """Peak resident memory above the level at entry.

    On Linux the kernel keeps the exact peak (VmHWM), and writing 5 to /proc/self/clear_refs resets it, so
    a run needs no watcher at all. Elsewhere a thread samples the resident size every few milliseconds; on
    a machine whose cores all compute, that thread takes a core from them now and then (measured here: a
    decode step about 5% slower on 2 cores), which is why it is only the fallback.
    """

    def __init__(self, interval: float = 0.003):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return 0

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.base = self._rss()
        self.peak = self.base
        if not _reset_high_water_mark():
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is None:
            self.peak = max(self.peak, _high_water_mark() or 0)
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def sampled(self) -> bool:
        """True when the peak was sampled by a thread rather than read from the kernel."""
        return self._thread is not None

    @property
    def delta(self) -> int:
        return self.peak - self.base
