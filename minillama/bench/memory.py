"""Peak resident memory of a run, sampled from a thread."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

class PeakRSS:
    """Peak resident memory above the level at entry, sampled every few milliseconds (Linux /proc)."""

    def __init__(self, interval: float = 0.003):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
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
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base
