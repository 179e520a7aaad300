"""User datasets: JSONL and Parquet through a field mapping; errors name file, row, field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlaxkit.tasks import (
    DatasetError,
    FieldMapping,
    Problem,
    load_problems,
    make_task,
    write_problems,
)

GSM8K_FIELDS = FieldMapping(id="qid", prompt="question", messages=None, answer="solution")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def good_row(i):
    return {"qid": f"q{i}", "question": f"What is {i}+1?", "solution": f"#### {i + 1}"}


def test_jsonl_with_field_mapping(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", [good_row(1), "", good_row(2)])
    loaded = load_problems(path, GSM8K_FIELDS)
    assert [p.id for p in loaded.problems] == ["q1", "q2"]
    assert loaded.problems[0].prompt == "What is 1+1?"
    assert loaded.problems[0].answer == "#### 2"
    assert loaded.skipped == 0


@pytest.mark.parametrize(
    ("bad_row", "field", "message"),
    [
        ('{"qid": "q", "question": "x", ', "<json>", "Expecting"),
        ("[1, 2]", "<row>", "expected an object"),
        ({"qid": "q9", "question": "x"}, "solution", "missing or null"),
        ({"qid": "q9", "question": "x", "solution": None}, "solution", "missing or null"),
        ({"qid": "q9", "question": 42, "solution": "1"}, "question", "expected a string"),
        ({"qid": "q9", "solution": "1"}, "question", "missing or null"),
        ({"qid": ["q"], "question": "x", "solution": "1"}, "qid", "non-empty string"),
        ({"qid": "q1", "question": "x", "solution": "1"}, "qid", "repeats row 1"),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, bad_row, field, message):
    path = write_jsonl(tmp_path / "data.jsonl", [good_row(1), good_row(2), bad_row, good_row(3)])
    with pytest.raises(DatasetError, match=message) as info:
        load_problems(path, GSM8K_FIELDS)
    error = info.value
    assert (error.path, error.row, error.field) == (str(path), 3, field)
    assert str(error).startswith(f"{path}: row 3: field '{field}': ")


def test_skip_mode_counts_and_keeps_messages(tmp_path):
    rows = [good_row(1), "not json", {"qid": "q5", "question": 1, "solution": "2"}, good_row(2)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    loaded = load_problems(path, GSM8K_FIELDS, on_error="skip")
    assert [p.id for p in loaded.problems] == ["q1", "q2"]
    assert loaded.skipped == 2
    assert "row 2: field '<json>'" in loaded.errors[0]
    assert "row 3: field 'question'" in loaded.errors[1]


def test_messages_and_derived_ids(tmp_path):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}]
    rows = [{"msgs": messages, "ans": 4, "level": 3}, {"msgs": [{"role": "user"}], "ans": 1}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    fields = FieldMapping(id=None, prompt=None, messages="msgs", answer="ans", metadata=("level",))
    with pytest.raises(DatasetError, match="row 2: field 'msgs': message 0"):
        load_problems(path, fields)
    problem = load_problems(path, fields, on_error="skip").problems[0]
    assert problem.messages == tuple(messages)
    assert problem.metadata == {"level": 3}
    assert problem.id == load_problems(path, fields, on_error="skip").problems[0].id
    assert problem.id.startswith("row-")


def test_parquet(tmp_path):
    table = pa.table(
        {
            "qid": ["a", "b", "c"],
            "question": ["1+1?", "2+2?", "3+3?"],
            "solution": ["2", None, "6"],
        }
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=r"data.parquet: row 2: field 'solution': missing"):
        load_problems(path, GSM8K_FIELDS)
    loaded = load_problems(path, GSM8K_FIELDS, on_error="skip")
    assert [p.id for p in loaded.problems] == ["a", "c"] and loaded.skipped == 1


def test_round_trip_through_write_problems(tmp_path):
    problems = make_task("countdown").problems("train", 5) + [
        Problem(id="m", prompt=None, answer="1", messages=({"role": "user", "content": "hi"},))
    ]
    write_problems(tmp_path / "out.jsonl", problems)
    assert load_problems(tmp_path / "out.jsonl").problems == problems


def test_tasks_read_user_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [good_row(i) for i in range(40)])
    task = make_task("math", train_path=str(train), fields=GSM8K_FIELDS)
    train_ids = {p.id for p in task.problems("train")}
    test_ids = {p.id for p in task.problems("test")}
    assert train_ids | test_ids == {f"q{i}" for i in range(40)}
    assert not train_ids & test_ids and test_ids
    problem = task.problems("train", 1)[0]
    assert task.score(problem, rf"\boxed{{{int(problem.id[1:]) + 1}}}").score == 1.0

    code_rows = [{"id": "c1", "prompt": "echo", "answer": [{"input": "a\n", "output": "a\n"}]}]
    code_file = write_jsonl(tmp_path / "code.jsonl", code_rows)
    code = make_task("code", train_path=str(code_file), test_path=str(code_file))
    assert code.problems("test")[0].id == "c1"
    write_jsonl(code_file, [{"id": "c2", "prompt": "x", "answer": "not tests"}])
    with pytest.raises(ValueError, match="problem c2: answer must be a non-empty list"):
        code.problems("train")


def test_missing_file_and_bad_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"on_error must be one of \['raise', 'skip'\]"):
        load_problems(tmp_path / "nope.jsonl", on_error="ignore")
    with pytest.raises(ValueError, match="at least one of prompt and messages"):
        FieldMapping(prompt=None, messages=None)
