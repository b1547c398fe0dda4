"""Progress reporting for the pipeline steps: a tqdm bar with an ETA on stderr, drawn only when stderr is a terminal,
and log lines on stdout, which are the record when the output goes to a file (a bar redrawn with carriage returns
would only clutter it). Log lines go through `say`, so they never tear a bar that is being drawn."""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int, *, desc: str, unit: str, initial: int = 0, quiet: bool = False) -> tqdm:
    """A progress bar over `total` units, `initial` of them already done (a resumed step); `quiet` hides it (e.g. on
    every process but the first of a multi-host run)."""
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=True if quiet else None)  # None: only on a terminal


def say(line: str) -> None:
    """Print a log line (flushed, so a log file follows the run) without tearing an active bar."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def duration(seconds: float) -> str:
    """Seconds -> "H:MM:SS" (ETAs in log lines)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
