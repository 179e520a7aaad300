"""Metrics leave through here: a JSONL file, an in-memory history, and a progress bar.

Every trainer step produces one flat dict of numbers; ``MetricsLogger.log`` appends it
to ``metrics.jsonl`` in the run directory (when there is one), keeps it in ``history``
for notebooks, and updates the progress bar with the figures a researcher watches:
step, reward, pass rate, staleness and tokens/s.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from tqdm.auto import tqdm

PROGRESS_KEYS = {
    "reward": "reward/mean",
    "pass": "reward/pass_rate",
    "stale": "staleness/mean",
    "tok/s": "throughput/tokens_per_s",
}


def _plain(value: object) -> object:
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible, not silently dropped
    return value


class MetricsLogger:
    """Writes one JSON object per step and keeps the history.

    Args:
        path: ``metrics.jsonl`` to append to, or ``None`` to keep metrics in memory only.
        total_steps: length of the progress bar; ``None`` disables the bar.
        progress: show a progress bar (off in tests and notebooks that plot instead).
    """

    def __init__(
        self, path: str | Path | None = None, total_steps: int | None = None, progress: bool = True
    ):
        self.path = Path(path) if path else None
        self.history: list[dict[str, object]] = []
        self._file = open(self.path, "a") if self.path else None  # noqa: SIM115
        self._bar = (
            tqdm(total=total_steps, desc="rl", unit="step", dynamic_ncols=True)
            if progress and total_steps
            else None
        )

    def log(self, metrics: Mapping[str, object]) -> None:
        """Records one step's metrics."""
        row = {k: _plain(v) for k, v in metrics.items()}
        self.history.append(row)
        if self._file:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._bar is not None:
            shown = {}
            for label, key in PROGRESS_KEYS.items():
                if isinstance(row.get(key), int | float):
                    shown[label] = f"{row[key]:.3g}"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

    def rewrite(self, rows: list[dict[str, object]]) -> None:
        """Replaces the history (and ``metrics.jsonl``) with ``rows``: a trainer restore
        keeps each step once, the ones it went back over gone."""
        self.history = [{k: _plain(v) for k, v in row.items()} for row in rows]
        if self._file and self.path:
            self._file.close()
            replace_lines(self.path, [json.dumps(row) for row in self.history])
            self._file = open(self.path, "a")  # noqa: SIM115
        if self._bar is not None:
            self._bar.n = len(rows)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file:
            self._file.close()
            self._file = None


def replace_lines(path: Path, lines: list[str]) -> None:
    """Writes ``lines`` to ``path`` atomically (a scratch file, then a rename)."""
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(scratch, path)


def read_metrics(path: str | Path) -> list[dict[str, object]]:
    """Reads a ``metrics.jsonl`` file back into a list of dicts."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
