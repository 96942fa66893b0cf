"""Where ``rpcps local`` writes what it says, and how its progress looks there.

On a terminal the progress line is a bar (tqdm) redrawn in place: steps held out of all, the time
left at the rate they come, and the rest of the progress line beside it; every other line (restarts,
resumes, errors) is written above the bar, which is drawn again below it. Anywhere else (a CI log,
a pipe, a file) each progress line is a plain line of its own, as ``cli.progress`` formats it:
a bar's carriage returns would fill a log with every redraw.

What must not live here: what a line says (``cli.progress``) or where its facts come from (``cli.local``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from cli.progress import Progress

if TYPE_CHECKING:
    from tqdm import tqdm

BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n}/{total} steps [{elapsed}<{remaining}]{postfix}"
"""The bar's own part counts the steps the servers hold; the postfix says the rest of the progress line."""


class Console:
    """``local``'s output: ``say`` a line, show ``progress``, ``close`` before the last line.

    Args:
        total_steps: the steps of every worker slot together (the bar's 100 %).
        out: where lines and the bar go (default: stdout); errors go to stderr.
        bar: draw a bar (default: when ``out`` is a terminal and ``total_steps`` > 0).
    """

    def __init__(self, total_steps: int, out: TextIO | None = None, *, bar: bool | None = None) -> None:
        self._out = sys.stdout if out is None else out
        if bar is None:
            bar = self._out.isatty()
        self._bar: tqdm | None = None
        if bar and total_steps > 0:
            from tqdm import tqdm  # only where a bar is drawn: a pipe or a CI log never loads it

            # miniters/mininterval 0: every progress() redraws (local calls it every --progress-s, not per step).
            self._bar = tqdm(total=total_steps, file=self._out, bar_format=BAR_FORMAT, dynamic_ncols=True,
                             mininterval=0, miniters=0, smoothing=0.3)

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def say(self, text: str, *, error: bool = False) -> None:
        """Writes a line (to stderr when ``error``), above the bar when there is one."""
        file = sys.stderr if error else self._out
        if self._bar is not None:
            self._bar.write(text, file=file)
        else:
            print(text, file=file, flush=True)

    def progress(self, line: Progress) -> None:
        """Shows a progress line: the bar moved to the steps held, or a plain line."""
        if self._bar is None:
            print(line.line(), file=self._out, flush=True)
            return
        if line.steps_held is not None:
            self._bar.n = line.steps_held  # may go back: a server that resumed from an older snapshot holds fewer
        self._bar.set_postfix_str(line.status(), refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        """Leaves the bar as it last was, so the lines after it start below it."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
