"""User datasets: JSONL and Parquet files read into ``Problem``s through a field mapping.

A malformed row (not UTF-8, not JSON, a field missing or of the wrong type, an empty
prompt, a repeated id) raises ``DatasetError`` naming the file, the row (1-based: the line
of a JSONL file, the record of a Parquet file) and the field; with ``on_error="skip"`` it
is skipped instead and named in the returned ``LoadedDataset`` (a ``SkippedRow``: file,
row, field, reason; the first few are logged). A file that yields no problem at all raises
``EmptyDatasetError`` naming it. A run writes every skipped row to ``skipped_rows.jsonl``
in its directory (``write_skipped_rows``).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlaxkit.rules.validation import is_int
from rlaxkit.tasks.base import Problem, SkippedRow, check_choice, stable_id

FileFormat = Literal["auto", "jsonl", "parquet"]
OnError = Literal["raise", "skip"]
LOGGED_SKIPS = 3  # skipped rows of a file named in the log; the rest in skipped_rows.jsonl
_LOGGER = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A row of a dataset file that cannot become a problem."""

    def __init__(self, path: str | Path, row: int, field_name: str, message: str):
        self.path, self.row, self.field, self.reason = str(path), row, field_name, message
        super().__init__(f"{path}: row {row}: field {field_name!r}: {message}")


class EmptyDatasetError(ValueError):
    """A dataset file that yields no problem: empty, or every row skipped."""

    def __init__(self, path: str | Path, skipped: int, first_error: str | None = None):
        self.path, self.skipped = str(path), skipped
        if skipped:
            message = (
                f"{path}: all {skipped} row(s) were skipped as malformed, so the file holds "
                f"no problem; the first: {first_error}"
            )
        else:
            message = (
                f"{path}: the dataset file holds no rows; give a JSONL/Parquet file of problems"
            )
        super().__init__(message)


@dataclass(frozen=True, kw_only=True)
class FieldMapping:
    """Which column of a row holds each part of a problem.

    The defaults read files written by ``write_problems`` (``Problem.to_dict``).

    Attributes:
      id: column of the stable id; ``None`` derives one from a hash of the prompt.
      prompt: column of the prompt text (may be absent or null when messages are given).
      messages: column of chat messages (a list of ``{"role", "content"}`` objects).
      answer: column of the reference answer (required, not null).
      metadata: columns copied into ``Problem.metadata``; the column named ``"metadata"``,
        when it holds an object, is merged in as well.
    """

    id: str | None = "id"
    prompt: str | None = "prompt"
    messages: str | None = "messages"
    answer: str = "answer"
    metadata: tuple[str, ...] = ()

    def __post_init__(self):
        if self.prompt is None and self.messages is None:
            raise ValueError("at least one of prompt and messages must name a column")
        if not isinstance(self.metadata, tuple):
            raise ValueError(f"metadata must be a tuple of column names, got {self.metadata!r}")


@dataclass(frozen=True)
class LoadedDataset:
    """Problems read from a file, with what was skipped (``on_error="skip"`` only):
    ``skipped`` rows, ``errors`` their messages, ``skipped_rows`` each named."""

    problems: list[Problem]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    skipped_rows: tuple[SkippedRow, ...] = ()


def write_skipped_rows(path: str | Path, rows: Iterable[SkippedRow]) -> int:
    """Writes ``rows`` to ``path`` as JSON lines (``file``, ``row``, ``field``,
    ``reason``), replacing it; returns how many. Nothing is written for none."""
    lines = [json.dumps(asdict(row)) + "\n" for row in rows]
    if lines:
        Path(path).write_text("".join(lines), encoding="utf-8")
    return len(lines)


SKIPPED_ROWS_FILE = "skipped_rows.jsonl"  # a run's dataset rows skipped as malformed


def write_run_skipped_rows(
    skipped: Mapping[str, Iterable[SkippedRow]], run_dir: str | Path | None
) -> int:
    """``run_dir/skipped_rows.jsonl``: every row of every file in ``skipped`` (a task's
    ``skipped_rows``); nothing without a run directory. Returns how many."""
    if run_dir is None:
        return 0
    rows = [row for rows in skipped.values() for row in rows]
    return write_skipped_rows(Path(run_dir) / SKIPPED_ROWS_FILE, rows)


def load_problems(
    path: str | Path,
    fields: FieldMapping | None = None,
    *,
    file_format: FileFormat = "auto",
    on_error: OnError = "raise",
    id_prefix: str = "row",
) -> LoadedDataset:
    """Reads a JSONL or Parquet file into problems.

    Args:
      path: the file; ``file_format="auto"`` picks the reader by suffix (``.parquet``,
        ``.pq``: Parquet; anything else: JSONL).
      fields: the field mapping (defaults read ``write_problems`` output).
      file_format: ``"auto"``, ``"jsonl"`` or ``"parquet"``.
      on_error: ``"raise"`` a ``DatasetError``, or ``"skip"`` and count malformed rows.
      id_prefix: prefix of derived ids when ``fields.id`` is ``None``.

    Raises:
      DatasetError: a malformed row (``on_error="raise"``) or a repeated id.
      EmptyDatasetError: the file yields no problem (it is empty, or every row was
        skipped).
      FileNotFoundError: no such file.
    """
    check_choice("file_format", file_format, FileFormat)
    check_choice("on_error", on_error, OnError)
    fields = fields or FieldMapping()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    if file_format == "auto":
        file_format = "parquet" if path.suffix in (".parquet", ".pq") else "jsonl"
    rows = _parquet_rows(path) if file_format == "parquet" else _jsonl_rows(path)
    problems: list[Problem] = []
    errors: list[str] = []
    skipped: list[SkippedRow] = []
    seen: dict[str, int] = {}
    for row_number, row in rows:
        try:
            if isinstance(row, DatasetError):
                raise row
            problem = _to_problem(path, row_number, row, fields, id_prefix)
            if problem.id in seen:
                raise DatasetError(
                    path,
                    row_number,
                    fields.id or "id",
                    f"id {problem.id!r} repeats row {seen[problem.id]}",
                )
        except DatasetError as error:
            if on_error == "raise":
                raise
            errors.append(str(error))
            skipped.append(SkippedRow(error.path, error.row, error.field, error.reason))
            continue
        seen[problem.id] = row_number
        problems.append(problem)
    if not problems:
        raise EmptyDatasetError(path, len(errors), errors[0] if errors else None)
    if skipped:
        first = "; ".join(
            f"row {r.row} field {r.field!r}: {r.reason}" for r in skipped[:LOGGED_SKIPS]
        )
        _log_skipped(
            f"{path}: skipped {len(skipped)} malformed row(s) (on_error=skip), the first: {first}"
        )
    return LoadedDataset(problems, skipped=len(errors), errors=errors, skipped_rows=tuple(skipped))


@functools.cache
def _log_skipped(message: str) -> None:
    """Logs ``message`` once per process (a file is read for each split, and again by
    each process of a run)."""
    _LOGGER.warning(message)


def check_train_split(path: str | Path, selected: int, loaded: int, test_fraction: float) -> None:
    """Raises when a file's ``loaded`` problems put none in the train split (``selected``).

    A file split by ``split_of`` with a large ``test_fraction`` (or few problems) can
    leave nothing to train on; the run would only say that the split is empty.
    """
    if selected == 0:
        raise ValueError(
            f"{path}: none of its {loaded} problem(s) falls in the train split "
            f"(test_fraction={test_fraction}); lower test_fraction, add problems, or give "
            "test_path so that this file is all training data"
        )


def write_problems(path: str | Path, problems: Sequence[Problem]) -> None:
    """Writes problems as JSONL (one ``Problem.to_dict`` per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for problem in problems:
            out.write(json.dumps(problem.to_dict(), ensure_ascii=False) + "\n")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    # Bytes, decoded line by line, so that a byte that is not UTF-8 fails its row only.
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield (
                    line_number,
                    DatasetError(
                        path,
                        line_number,
                        "<utf-8>",
                        f"byte 0x{raw[error.start]:02x} (byte {error.start + 1} of the line) is "
                        "not UTF-8; re-encode the file as UTF-8",
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                yield line_number, DatasetError(path, line_number, "<json>", error.msg)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq  # imported here: reward workers never need pyarrow

    row_number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            row_number += 1
            yield row_number, row


def _to_problem(
    path: Path, row_number: int, row: object, fields: FieldMapping, id_prefix: str
) -> Problem:
    def fail(field_name: str, message: str) -> DatasetError:
        return DatasetError(path, row_number, field_name, message)

    if not isinstance(row, Mapping):
        raise fail("<row>", f"expected an object, got {type(row).__name__}")
    prompt = None
    if fields.prompt:
        prompt = row.get(fields.prompt)
        if prompt is not None and not isinstance(prompt, str):
            raise fail(fields.prompt, f"expected a string, got {type(prompt).__name__}")
    messages = None
    if fields.messages:
        messages = _messages(row.get(fields.messages), fail, fields.messages)
    if prompt is None and messages is None:
        named = [name for name in (fields.prompt, fields.messages) if name]
        raise fail(" or ".join(named), "missing or null")
    if prompt is not None and not prompt.strip() and messages is None:
        raise fail(fields.prompt or "prompt", "empty; give the problem text or drop the row")
    if fields.answer not in row or row[fields.answer] is None:
        raise fail(fields.answer, "missing or null")
    metadata: dict[str, Any] = {}
    if isinstance(row.get("metadata"), Mapping):
        metadata.update(row["metadata"])
    for name in fields.metadata:
        if name not in row:
            raise fail(name, "missing")
        metadata[name] = row[name]
    if fields.id is None:
        text = prompt if prompt is not None else json.dumps(messages, sort_keys=True)
        problem_id = stable_id(id_prefix, text)
    else:
        raw_id = row.get(fields.id)
        if is_int(raw_id):
            raw_id = str(raw_id)
        if not isinstance(raw_id, str) or not raw_id:
            raise fail(fields.id, f"expected a non-empty string or integer, got {raw_id!r}")
        problem_id = raw_id
    return Problem(
        id=problem_id,
        prompt=prompt,
        answer=row[fields.answer],
        messages=messages,
        metadata=metadata,
    )


def _messages(
    value: object, fail: Callable[[str, str], DatasetError], field_name: str
) -> tuple[dict[str, str], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise fail(field_name, "expected a non-empty list of {role, content} objects")
    for i, message in enumerate(value):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise fail(field_name, f"message {i} is not a {{role, content}} object of strings")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)
