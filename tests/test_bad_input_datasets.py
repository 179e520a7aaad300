"""Bad dataset files get errors naming the file, the row and the fix; skipped rows are
named where a run can read them: the log names the first few, ``skipped_rows.jsonl``
all."""

import json
import logging

import pytest

from rlaxkit.tasks import make_task
from rlaxkit.tasks.datasets import (
    DatasetError,
    EmptyDatasetError,
    SkippedRow,
    load_problems,
    write_skipped_rows,
)

GOOD = {"id": "a", "prompt": "1+1", "answer": "2"}


def _write(path, *lines: bytes):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _row(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def test_a_byte_that_is_not_utf8_names_file_and_row(tmp_path):
    path = _write(tmp_path / "d.jsonl", _row(), b'{"id": "b", "prompt": "x\xff", "answer": "2"}')
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 2: field '<utf-8>': byte 0xff") as err:
        load_problems(path)
    assert "re-encode the file as UTF-8" in str(err.value) and err.value.row == 2


def test_a_byte_that_is_not_utf8_is_skipped_and_counted(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        _row(),
        b'{"id": "b", "prompt": "\xff\xfe", "answer": "2"}',
        _row(id="c"),
    )
    loaded = load_problems(path, on_error="skip")
    assert [p.id for p in loaded.problems] == ["a", "c"]
    assert loaded.skipped == 1 and "row 2" in loaded.errors[0]


@pytest.mark.parametrize("prompt", ["", "  \n "])
def test_an_empty_prompt_is_refused_at_load_time(tmp_path, prompt):
    path = _write(tmp_path / "d.jsonl", _row(), _row(id="b", prompt=prompt))
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 2: field 'prompt': empty; give"):
        load_problems(path)
    loaded = load_problems(path, on_error="skip")
    assert [p.id for p in loaded.problems] == ["a"] and loaded.skipped == 1


def test_an_empty_prompt_with_messages_is_kept(tmp_path):
    messages = [{"role": "user", "content": "1+1"}]
    path = _write(tmp_path / "d.jsonl", _row(prompt="", messages=messages))
    assert load_problems(path).problems[0].messages == tuple(messages)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_file_names_the_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(EmptyDatasetError, match=r"empty\.jsonl: the dataset file holds no rows"):
        load_problems(path, on_error="skip")


def test_a_file_whose_every_row_is_skipped_names_the_file_and_the_first_error(tmp_path):
    path = _write(tmp_path / "d.jsonl", b"not json", _row(answer=None))
    with pytest.raises(EmptyDatasetError, match=r"d\.jsonl: all 2 row\(s\) were skipped") as err:
        load_problems(path, on_error="skip")
    assert err.value.skipped == 2 and "row 1" in str(err.value)


@pytest.mark.parametrize("name", ["math", "code"])
def test_a_file_task_exposes_its_skipped_rows(tmp_path, name):
    tests = [{"input": "", "output": "2"}]
    path = _write(
        tmp_path / "d.jsonl",
        *[_row(id=f"p{i}", answer=tests if name == "code" else "2") for i in range(20)],
        b"not json",
        _row(id="p0"),  # a repeated id
    )
    task = make_task(name, train_path=str(path), on_error="skip")
    assert task.skipped_rows == {}
    train, test = task.problems("train"), task.problems("test")
    assert len(train) + len(test) == 20
    file = str(path)
    assert task.skipped_rows == {
        file: (
            SkippedRow(file, 21, "<json>", "Expecting value"),
            SkippedRow(file, 22, "id", "id 'p0' repeats row 1"),
        )
    }


def test_skipped_rows_are_named_in_the_log_and_a_file(tmp_path, caplog):
    path = _write(
        tmp_path / "d.jsonl",
        _row(),
        *[_row(id=f"e{i}", prompt="") for i in range(4)],  # rows 2-5
        _row(id="b", answer=None),  # row 6
    )
    with caplog.at_level(logging.WARNING, logger="rlaxkit.tasks.datasets"):
        loaded = load_problems(path, on_error="skip")
    (message,) = caplog.messages
    # The first three, by row and field; the file names all five.
    assert message.startswith(f"{path}: skipped 5 malformed row(s) (on_error=skip), the first:")
    assert "row 2 field 'prompt'" in message and "row 4 field 'prompt'" in message
    assert "row 5" not in message and "row 6" not in message
    out = tmp_path / "skipped_rows.jsonl"
    assert write_skipped_rows(out, loaded.skipped_rows) == 5
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["file"], r["row"], r["field"]) for r in rows] == [
        *[(str(path), row, "prompt") for row in (2, 3, 4, 5)],
        (str(path), 6, "answer"),
    ]
    assert rows[0]["reason"].startswith("empty")


@pytest.mark.parametrize("name", ["math", "code"])
def test_a_file_with_nothing_in_the_train_split_is_named(tmp_path, name):
    answer = [{"input": "", "output": "2"}] if name == "code" else "2"
    path = _write(tmp_path / "d.jsonl", _row(answer=answer))
    task = make_task(name, train_path=str(path), test_fraction=1.0)
    with pytest.raises(
        ValueError, match=r"d\.jsonl: none of its 1 problem\(s\) falls in the train"
    ):
        task.problems("train")
    assert len(task.problems("test")) == 1


def test_a_run_on_a_bad_dataset_fails_before_it_makes_its_folder(tmp_path):
    """Experiment reads the training data first: an empty file is named, and no run
    folder, warm start or worker exists yet."""
    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import Experiment
    from rlaxkit.tasks import EmptyDatasetError

    data = tmp_path / "train.jsonl"
    data.write_text("")
    config = small_run_config(
        "task.name=math", f"task.options.train_path={data}", "model.config.vocab_size=128"
    )
    with pytest.raises(EmptyDatasetError, match="train.jsonl"):
        Experiment(config, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
