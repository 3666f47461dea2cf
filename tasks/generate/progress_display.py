"""Terminal view of generate progress: a rich Live panel on a terminal, a throttled status line elsewhere.

Why a line on stderr when stdout is no terminal: under nohup, a CI log or a pipe, a Live display would write
cursor movements into the file, and a line per snapshot (every 2 s for hours) would bury everything else.
The Live panel starts with the first snapshot and stops with the final one, so the stages around generate
print their logs normally.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tasks.generate.progress import (
    ProgressSnapshot,
    add_event_listener,
    add_listener,
    event_line,
    status_fields,
    status_line,
)

LINE_EVERY_S = 10.0


def render(snapshot: ProgressSnapshot) -> RenderableType:
    bar = Table.grid(padding=(0, 1))
    bar.add_column(width=40)
    bar.add_column()
    title = "generate: budget cap reached" if snapshot.budget_stopped else "generate"
    bar.add_row(
        ProgressBar(total=max(snapshot.total, 1), completed=snapshot.finished, width=40),
        Text(f"{snapshot.percent:5.1f}%  {title}", style="bold"),
    )
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="cyan", no_wrap=True)
    fields.add_column()
    for label, value in status_fields(snapshot):
        fields.add_row(label, value)
    return Group(bar, fields)


class ProgressDisplay:
    """A progress listener; thread-safe, because the engine calls it from a worker thread."""

    def __init__(
        self,
        console: Console | None = None,
        *,
        line_stream: TextIO | None = None,
        line_every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or Console()
        self.live_mode = self.console.is_terminal
        self._line_stream = line_stream
        self._line_every_s = line_every_s
        self._clock = clock
        self._last_line: float | None = None
        self._live: Live | None = None
        self._lock = threading.Lock()
        self.latest: ProgressSnapshot | None = None

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            self.latest = snapshot
            if self.live_mode:
                self._show_live(snapshot)
            else:
                self._print_line(snapshot)

    def _show_live(self, snapshot: ProgressSnapshot) -> None:
        if self._live is None:
            self._live = Live(render(snapshot), console=self.console, refresh_per_second=2, transient=False)
            self._live.start(refresh=True)
        else:
            self._live.update(render(snapshot), refresh=True)
        if snapshot.final:
            self._stop_live()

    def _print_line(self, snapshot: ProgressSnapshot) -> None:
        now = self._clock()
        if not snapshot.final and self._last_line is not None and now - self._last_line < self._line_every_s:
            return
        self._last_line = now
        stream = self._line_stream or sys.stderr
        print(status_line(snapshot), file=stream, flush=True)

    def _stop_live(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def close(self) -> None:
        with self._lock:
            self._stop_live()


@contextmanager
def show_progress(
    enabled: bool = True, console: Console | None = None, events: bool = True
) -> Iterator[ProgressDisplay | None]:
    """Show every generate run in this process while the block runs (process-wide listener). Run events (an
    outage starting or ending, a budget stop, settled spend) print one line each on stderr even without the
    display, unless `events` is off: a Prefect flow run's log tells them (`flows.generate_progress`)."""
    out = Console(stderr=True, highlight=False, soft_wrap=True) if console is None else console
    remove_events = (
        add_event_listener(lambda event: out.print(event_line(event), markup=False)) if events else lambda: None
    )
    try:
        if not enabled:
            yield None
            return
        display = ProgressDisplay(console)
        remove = add_listener(display)
        try:
            yield display
        finally:
            remove()
            display.close()
    finally:
        remove_events()
