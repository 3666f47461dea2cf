"""The journal's prebuilt JSON encoders write exactly what `json.dumps` writes, so segments written before and
after them read the same, and a record read back is the record written."""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from tasks.generate import journal
from tasks.generate.journal import AppendLog, encode_frame, read_records

RECORDS: list[Any] = [
    {"k": "s", "a": "00000001764590000000000-1234:12345", "id": "ds/ä-1", "d": "bench", "p": 3, "w": 0.0123},
    {"k": "b", "a": "t:1", "c": None, "g": "gen-\u2028x", "r": "finish_error"},
    {
        "p": 0,
        "r": {
            "sample_id": 'quote " backslash \\ tab \t nl \n nul \x00 del \x7f',
            "reasoning": "思考 " * 50 + "\U0001f600 astral",
            "content": "</think> and \ud800 lone surrogate",
            "cost_usd": 1e-07,
            "big": 1e300,
            "neg_zero": -0.0,
            "tokens": 2**70,
            "ok": True,
            "no": False,
            "output_ids": [1, 2, 3],
            "history": [{"role": "user", "content": "hi", "generated": False}],
            "empty": {},
            "none": None,
        },
    },
    [1, "two", 3.5, None],
    {"nan": math.nan, "inf": math.inf, "-inf": -math.inf},
]


def reference_frame(record: Any, compact: bool) -> bytes:
    text = json.dumps(record, separators=(",", ":"), ensure_ascii=False) if compact else json.dumps(record)
    payload = text.encode()
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("index", range(len(RECORDS)))
def test_frames_equal_json_dumps(index: int, compact: bool) -> None:
    record = RECORDS[index]
    if compact and index == 2:  # a lone surrogate cannot be UTF-8 encoded unescaped, with either encoder
        with pytest.raises(UnicodeEncodeError):
            encode_frame(record, compact=True)
        with pytest.raises(UnicodeEncodeError):
            json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
        return
    assert encode_frame(record, compact=compact) == reference_frame(record, compact)


@pytest.mark.parametrize("ascii_only", [True, False])
def test_encoder_without_c_accelerator_is_json_dumps(monkeypatch: pytest.MonkeyPatch, ascii_only: bool) -> None:
    monkeypatch.setattr(journal, "c_make_encoder", None)
    encode = journal._json_encoder(ascii_only)
    record = RECORDS[0]
    expected = json.dumps(record) if ascii_only else json.dumps(record, separators=(",", ":"), ensure_ascii=False)
    assert encode(record) == expected


def test_unserialisable_value_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode_frame({"path": Path("/x")})
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode_frame({"path": Path("/x")}, compact=False)


def test_records_read_back_as_written(tmp_path: Path) -> None:
    log = AppendLog(tmp_path / "j.log", 0.2)
    readable = [r for i, r in enumerate(RECORDS) if i != 2]
    for record in readable[:2]:
        log.write_now(record)
    for record in readable[2:]:
        log.submit(record)
    log.close()
    back = list(read_records(tmp_path / "j.log"))
    assert json.dumps(back) == json.dumps(readable)


def test_a_record_submitted_to_an_idle_log_reaches_the_file_without_close(tmp_path: Path) -> None:
    """The writer thread sleeps while it has nothing to do; the next record must wake it (a kill -9 after that
    record's answer was paid for must find it in the file), as must a `write_now` record's fsync."""
    path = tmp_path / "segment.log"
    log = AppendLog(path, group_commit_s=0.05)
    try:
        time.sleep(0.2)  # idle: nothing queued, nothing to fsync
        log.submit({"n": 1})
        deadline = time.monotonic() + 10
        while not list(read_records(path)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(read_records(path)) == [{"n": 1}]
        time.sleep(0.2)
        log.write_now({"n": 2})
        log.submit({"n": 3})
        while len(list(read_records(path))) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(read_records(path)) == [{"n": 1}, {"n": 2}, {"n": 3}]
    finally:
        log.close()
