"""A plain-text progress line on stderr for long replays (no dependency, no colours).

It redraws one line with a carriage return at most a few times a second, and only when the
stream is a terminal: logs and CI output stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 30


class Progress:
    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 interval: float = 0.25) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval = interval
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < self.interval:
            return
        self._last_draw = now
        elapsed = now - self.started
        fraction = done / total if total else 1.0
        filled = int(fraction * _BAR_WIDTH)
        left = f", ~{elapsed / fraction - elapsed:.0f}s left" if 0 < fraction < 1 else ""
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] "
            f"{done}/{total} ({fraction:.0%}) {elapsed:.0f}s{left}   "
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
