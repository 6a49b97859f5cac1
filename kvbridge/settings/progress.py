"""Progress of a long step, for a person watching: a bar on a terminal, a line per tenth in a log.

Where KVBridge makes people wait minutes it says how far it got: the llama.cpp compiles
(scripts/build_variants.py, which loads this file by path, so it imports nothing but the standard
library), the model downloads (kvbridge.settings.model_fetch). Whether the stream is a terminal
(`isatty()`) decides the shape:

    terminal  one line redrawn with '\\r' (at most every 0.2 s): label, bar, percent, detail
    log / CI  a line each time another tenth of the total is done, so a five-minute compile
              writes about ten lines, never one per file compiled

Deliberately left out: an ETA (compile steps differ too much in cost), nested bars, colours.
"""
from __future__ import annotations

import re
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24
REDRAW_S = 0.2          # a terminal bar is redrawn at most this often
UNKNOWN_TOTAL_S = 15.0  # in a log, without a total: at most one line this often
RATE_WINDOW_S = 5.0     # the rate shown is over the last few seconds, not since the start (pip starting, a stall)


def megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    """One long step: call `update(done, total)` as it advances and `finish()` at its end.

    unit "bytes" shows MB and the rate, "steps" shows N/M steps, "percent" only the percent."""

    def __init__(self, label: str, total: int | None = None, *, unit: str = "steps", stream: TextIO | None = None,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.started = clock()
        self.done = 0
        self._drawn_at = -1e9          # when the terminal line was last drawn (or the last log line written)
        self._drawn_width = 0          # the terminal line's width, to blank what a shorter one leaves
        self._tenth_written = -1       # in a log: the last tenth a line was written for
        self._updated = False
        self._samples: deque[tuple[float, int]] = deque()   # (when, done) within the rate window

    # -- what is shown -------------------------------------------------------------------------

    def percent(self) -> int | None:
        if not self.total:
            return None
        return max(0, min(100, int(100 * self.done / self.total)))

    def detail(self) -> str:
        if self.unit == "bytes":
            done = megabytes(self.done) if not self.total else f"{self.done / 1e6:.1f}/{megabytes(self.total)}"
            rate = self.rate()
            return done if rate is None else f"{done}, {megabytes(rate)}/s"
        if self.unit == "steps":
            return f"{self.done}/{self.total} steps" if self.total else f"{self.done} steps"
        return ""

    def rate(self) -> float | None:
        """Units per second over the last RATE_WINDOW_S, None before there is a second's worth of samples."""
        if len(self._samples) < 2:
            return None
        (first_at, first_done), (last_at, last_done) = self._samples[0], self._samples[-1]
        return (last_done - first_done) / (last_at - first_at) if last_at - first_at >= 0.5 else None

    def line(self) -> str:
        """The step's state as one line of a log: 'LABEL: 40% (77/193 steps)'."""
        percent, detail = self.percent(), self.detail()
        shown = f"{percent}%" if percent is not None else ""
        if detail:
            shown = f"{shown} ({detail})" if shown else detail
        return f"{self.label}: {shown}" if shown else self.label

    def bar(self) -> str:
        """The step's state as a terminal line: 'LABEL [#####.......]  40% 77/193 steps 95 s'."""
        percent = self.percent()
        filled = BAR_WIDTH * (percent or 0) // 100
        gauge = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {percent:3d}%" if percent is not None else ""
        parts = [self.label, gauge, self.detail(), f"{self.clock() - self.started:.0f} s"]
        return " ".join(part for part in parts if part)

    # -- advancing -----------------------------------------------------------------------------

    def update(self, done: int, total: int | None = None) -> None:
        if total:
            self.total = total
        self.done = done
        self._updated = True
        now = self.clock()
        self._samples.append((now, done))
        while len(self._samples) > 2 and (now - self._samples[1][0] >= RATE_WINDOW_S
                                          or self._samples[0][1] == self._samples[1][1]):   # a wait before the start
            self._samples.popleft()
        if self.tty:
            if now - self._drawn_at >= REDRAW_S:
                self._draw(now)
            return
        percent = self.percent()
        if percent is None:
            if now - self._drawn_at >= UNKNOWN_TOTAL_S:
                self._write_line(now)
        elif percent // 10 > self._tenth_written:
            self._tenth_written = percent // 10
            self._write_line(now)

    def finish(self, message: str | None = None) -> None:
        """The step ended: the final state (a terminal's line ended with a newline), then `message` if any."""
        now = self.clock()
        if self._updated:
            if self.tty:
                self._draw(now)
                self.stream.write("\n")
            elif self.percent() is None or self.percent() // 10 > self._tenth_written:
                self._write_line(now)
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()
        self._updated = False

    def _draw(self, now: float) -> None:
        text = self.bar()
        self.stream.write("\r" + text + " " * max(0, self._drawn_width - len(text)))
        self.stream.flush()
        self._drawn_width, self._drawn_at = len(text), now

    def _write_line(self, now: float) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._drawn_at = now


# -- the compilers' own progress ---------------------------------------------------------------

NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s")     # ninja (and scikit-build-core's verbose ninja): "[12/193] ..."
MAKE_PERCENT = re.compile(r"^\s*\[\s*(\d+)%\]\s")     # make via cmake: "[ 45%] Building CXX object ..."


def build_step(line: str) -> tuple[int, int, str] | None:
    """(done, total, unit) from one line of a cmake build's output, None for every other line."""
    if match := NINJA_STEP.match(line):
        return int(match[1]), int(match[2]), "steps"
    if match := MAKE_PERCENT.match(line):
        return int(match[1]), 100, "percent"
    return None


# what a pip build of llama-cpp-python does before its first compile step (a minute or more, on a slow network)
MILESTONES = ((re.compile(r"^\s*Downloading (\S+\.tar\.gz) \(([^)]+)\)"), "downloading its source {0} ({1})"),
              (re.compile(r"^\s*Installing build dependencies: started"), "installing its build tools"),
              (re.compile(r"^\s*\*\*\* Configuring CMake"), "configuring with cmake"))


def build_milestone(line: str) -> str | None:
    """What a line of a pip build's output says it starts, in words; None for every other line."""
    for pattern, words in MILESTONES:
        if match := pattern.match(line):
            return words.format(*match.groups())
    return None
