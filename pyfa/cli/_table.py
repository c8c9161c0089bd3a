"""Text output of the main job: aligned tables and a progress bar, with no
dependency beyond the standard library."""
from __future__ import annotations

import sys
import time


def table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> str:
    """Rows under headers, columns padded to their widest cell; the columns
    whose indices are in `right` are right-aligned (numbers)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


class Progress:
    """Progress over `total` steps. On a terminal: one line redrawn in place
    (`\\r`), cleared by close(). Elsewhere (a pipe, a log, a test): a plain
    line at the first step and at each tenth of the way, so a log shows
    about where a run stopped without a line per step."""

    WIDTH = 30

    def __init__(self, total: int, title: str, stream=None):
        self.total, self.title, self.done = max(total, 1), title, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """Marks one more step done; `label` says what it was."""
        self.done += 1
        if self.tty:
            filled = self.WIDTH * self.done // self.total
            bar = "#" * filled + "." * (self.WIDTH - filled)
            text = f"{self.title} [{bar}] {self.done}/{self.total} {label}"
            self.stream.write("\r" + text[:120].ljust(120))
        elif self.done == 1 or 10 * self.done // self.total != 10 * (self.done - 1) // self.total:
            self.stream.write(f"{self.title} {self.done}/{self.total} {label}\n")
        self.stream.flush()

    def close(self) -> float:
        """Clears the terminal line; returns the seconds since the start."""
        if self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
        return time.perf_counter() - self.start
