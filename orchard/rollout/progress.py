"""A rich progress bar for batches of rollouts (resolved and failed counts as it goes)."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RolloutProgress:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.resolved = self.aborted = 0
        self._progress = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), disable=not enabled)
        self._task = self._progress.add_task("rollouts", total=total, detail="")

    def __enter__(self) -> "RolloutProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def advance(self, sample: Any) -> None:
        self.resolved += sample.resolved
        self.aborted += sample.status.value == "aborted"
        self._progress.update(self._task, advance=1,
                              detail=f"resolved {self.resolved}, aborted {self.aborted}")
