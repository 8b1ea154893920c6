"""Records: appended as sealed strict JSON lines, never rewritten, readable after a crash;
a torn, edited or foreign line is reported with its number, never skipped in silence."""

import hashlib
import json
import math

import pytest

from kforge.harness.record import (MISMATCH, NO_CHECKSUM, NOT_AN_OBJECT, TORN, EvalRecord, RejectedLine, StoreWarning,
                                   append_record, read_records, read_store, seal, verify)


def make(status="passed", **kw):
    return EvalRecord(status=status, problem={"name": "p"}, candidate={"name": "c"}, device={}, versions={}, **kw)


def test_records_are_appended_and_earlier_lines_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"mine": "a line the user wrote"}\n')
    append_record(path, make())
    append_record(path, make("slower"))
    lines = path.read_text().splitlines()
    assert lines[0] == '{"mine": "a line the user wrote"}'
    assert [json.loads(line).get("status") for line in lines[1:]] == ["passed", "slower"]


def test_a_sealed_line_round_trips(tmp_path):
    path = tmp_path / "results.jsonl"
    record = make("slower", gate2={"speedup": 0.8}, pair_key="k")
    append_record(path, record)
    line = path.read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    stored = json.loads(line)  # plain JSON: the record's keys in order, the checksum last
    assert list(stored) == [*record.to_dict(), "checksum"] and '"status": "slower"' in line
    body = json.dumps(record.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert stored["checksum"] == "sha256:" + hashlib.sha256(body.encode("utf-8")).hexdigest()
    reading = read_store(path)
    assert reading.rejected == [] and reading.records == [record.to_dict()]  # the checksum key is removed


def test_a_torn_last_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "results.jsonl"
    append_record(path, make())
    append_record(path, make("slower"))
    with open(path, "a") as handle:
        handle.write('{"status": "pass')  # a crash mid-write
    reading = read_store(path)
    assert [r["status"] for r in reading.records] == ["passed", "slower"]
    assert reading.rejected == [RejectedLine(3, TORN)]
    assert reading.notes() == [f"{path} line 3: torn line (not JSON); left out"]


def test_a_record_appended_after_a_torn_line_is_kept_whole(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"status": "pass')  # a crash mid-write, then the next run appends
    append_record(path, make("slower"))
    reading = read_store(path)
    assert [r["status"] for r in reading.records] == ["slower"] and reading.rejected == [RejectedLine(1, TORN)]


def test_an_edited_field_is_a_checksum_mismatch(tmp_path):
    path = tmp_path / "results.jsonl"
    append_record(path, make())
    append_record(path, make("slower"))
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"status": "slower"', '"status": "passed"')
    path.write_text("\n".join(lines) + "\n")
    reading = read_store(path)
    assert [r["status"] for r in reading.records] == ["passed"]
    assert reading.rejected == [RejectedLine(2, MISMATCH)]


def test_a_line_without_a_checksum_or_not_an_object_is_foreign(tmp_path):
    path = tmp_path / "results.jsonl"
    unsealed = make("passed").to_json()  # a record as it was written before checksums
    path.write_text(unsealed + "\n\n[1, 2]\n")
    append_record(path, make("slower"))
    reading = read_store(path)
    assert [r["status"] for r in reading.records] == ["slower"]
    assert reading.rejected == [RejectedLine(1, NO_CHECKSUM), RejectedLine(3, NOT_AN_OBJECT)]  # line 2 is blank


def test_read_records_warns_naming_the_file_and_each_rejected_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"status": "passed"}\n')
    append_record(path, make("slower"))
    with open(path, "a") as handle:
        handle.write('{"stat')
    with pytest.warns(StoreWarning) as caught:
        records = read_records(path)
    assert [r["status"] for r in records] == ["slower"]
    message = str(caught[0].message)
    assert str(path) in message and "line 1: no checksum" in message and "line 3: torn line (not JSON)" in message
    assert caught[0].message.reading.rejected == [RejectedLine(1, NO_CHECKSUM), RejectedLine(3, TORN)]


def test_a_clean_store_reads_without_a_warning(tmp_path, recwarn):
    path = tmp_path / "results.jsonl"
    append_record(path, make())
    assert [r["status"] for r in read_records(path)] == ["passed"]
    assert not [w for w in recwarn if issubclass(w.category, StoreWarning)]


def test_nan_and_inf_are_sealed_as_null_and_verify(tmp_path):
    sealed = seal({"rse": math.inf, "stats": [math.nan, 1.5]})
    assert sealed["rse"] is None and sealed["stats"] == [None, 1.5] and verify(sealed)
    assert not verify({"rse": math.nan, "checksum": sealed["checksum"]})  # not strict JSON: cannot verify
    path = tmp_path / "results.jsonl"
    append_record(path, make(gate2={"speedup": math.nan, "stats": {"candidate": {"rse": -math.inf}}}))
    reading = read_store(path)
    assert reading.rejected == []
    assert reading.records[0]["gate2"] == {"speedup": None, "stats": {"candidate": {"rse": None}}}


def test_a_sealed_record_is_not_sealed_again():
    with pytest.raises(ValueError):
        seal(seal({"status": "passed"}))


def test_infinities_become_null_so_the_json_stays_strict():
    record = make(gate2={"stats": {"candidate": {"rse": math.inf}}})
    assert json.loads(record.to_json())["gate2"]["stats"]["candidate"]["rse"] is None


@pytest.mark.parametrize("status, code", [
    ("passed", 0), ("incorrect", 1), ("slower", 1), ("faster_than_hardware", 1),
    ("candidate_error", 2), ("problem_error", 2),
])
def test_exit_status_by_status(status, code):
    assert make(status).exit_status == code


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError):
        make("fast")
