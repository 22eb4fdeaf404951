"""Progress of long commands (`glm5 quantize`, `glm5 export-onnx`) on stderr, so stdout stays the result:
a rich progress bar on a terminal, one plain line per step elsewhere (CI logs, pipes)."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console


class Phases:
    """`with Phases("quantize") as p: p.phase("loading"); p.phase("calibrating", total=78); p.advance()`."""

    def __init__(self, command: str, enabled: bool = True, console: Console | None = None) -> None:
        self.command, self.enabled = command, enabled
        self.console = console or Console(stderr=True, highlight=False)
        self.live = enabled and self.console.is_terminal
        self._progress = None
        self._task = None
        self._t0 = time.perf_counter()
        self._desc = ""
        self._total: int | None = None
        self._done = 0

    def __enter__(self) -> Phases:
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn(f"{self.command}: {{task.description}}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("", total=None)
        return self

    def phase(self, description: str, total: int | None = None) -> None:
        """Start a step (with `total` units to advance through, or None for an indefinite one)."""
        self._desc, self._total, self._done = description, total, 0
        if self._progress is not None:
            self._progress.update(self._task, description=description, total=total, completed=0)
        elif self.enabled:
            self._line(description + (f" (0/{total})" if total else ""))

    def advance(self, n: int = 1, detail: str | None = None) -> None:
        self._done += n
        if self._progress is not None:
            desc = self._desc + (f" {detail}" if detail else "")
            self._progress.update(self._task, advance=n, description=desc)
        elif self.enabled:
            self._line(f"{self._desc} {self._done}/{self._total}" + (f" {detail}" if detail else ""))

    def _line(self, text: str) -> None:
        self.console.print(f"{self.command}: {text} [{time.perf_counter() - self._t0:.1f}s]", markup=False)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
