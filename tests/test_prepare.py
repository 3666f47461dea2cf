from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.common.config import PipelineConfig
from tasks.common.messages import sample_id
from tasks.common.shards import PartRef, done_parts, read_part
from tasks.prepare.datasets import prepare_datasets


def make_cfg(tmp_path: Path, datasets: list[dict[str, object]], per_shard: int = 4) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run_dir": tmp_path / "run",
            "samples_per_shard": per_shard,
            "datasets": datasets,
            "endpoint": {"model": "m"},
            "tokenizer": {"path": tmp_path},
        }
    )


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


GOOD = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(6)]


def test_jsonl_messages_sharded_deduplicated_and_quarantined(tmp_path: Path) -> None:
    bad = [
        '{"messages": [',
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"text": "wrong shape"},
        {"messages": [{"role": "assistant", "content": "only an answer"}]},
    ]
    rows = [*GOOD[:3], *bad, GOOD[0], *GOOD[3:]]
    cfg = make_cfg(tmp_path, [{"name": "B1", "path": write_jsonl(tmp_path / "b1.jsonl", rows)}])
    result = prepare_datasets(cfg)

    counts = result.datasets["B1"]
    assert (counts.rows_read, counts.kept, counts.duplicates, counts.quarantined) == (14, 6, 1, 7)
    assert result.parts == [0, 1]
    table = pa.concat_tables([read_part(r) for r in done_parts(cfg.run_dir, "prompts")])
    assert table.num_rows == 6
    assert len(set(table["sample_id"].to_pylist())) == 6
    first = table.slice(0, 1).to_pylist()[0]
    assert first["messages"] == [{"role": "user", "content": "q0"}]
    assert first["sample_id"] == sample_id("B1", [{"role": "user", "content": "q0"}])

    reasons = [json.loads(line)["reason"] for line in result.quarantine_path.read_text().splitlines()]
    assert len(reasons) == 7
    assert any("bad JSON" in r for r in reasons)
    assert any("has no 'role'" in r for r in reasons)
    assert any("empty content" in r for r in reasons)
    assert any("expected a string" in r for r in reasons)
    assert any("unknown role" in r for r in reasons)
    assert any("neither 'messages' nor 'conversations'" in r for r in reasons)
    assert any("no user turn" in r for r in reasons)


def test_parquet_sharegpt_and_trailing_assistant_dropped(tmp_path: Path) -> None:
    conv = [
        {"from": "system", "value": "be terse"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "someone else's answer"},
    ]
    path = tmp_path / "b3.parquet"
    pq.write_table(pa.Table.from_pylist([{"conversations": conv}]), path)
    cfg = make_cfg(tmp_path, [{"name": "B3", "path": path, "shape": "sharegpt"}])
    prepare_datasets(cfg)
    row = read_part(PartRef(cfg.run_dir, "prompts", 0)).to_pylist()[0]
    assert row["messages"] == [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]


def test_sample_ids_are_content_keyed_and_per_dataset(tmp_path: Path) -> None:
    a = make_cfg(tmp_path / "a", [{"name": "B1", "path": write_jsonl(tmp_path / "x.jsonl", GOOD)}])
    b = make_cfg(tmp_path / "b", [{"name": "B1", "path": write_jsonl(tmp_path / "y.jsonl", GOOD[::-1])}])
    c = make_cfg(tmp_path / "c", [{"name": "B2", "path": tmp_path / "x.jsonl"}])
    ids = []
    for cfg in (a, b, c):
        prepare_datasets(cfg)
        ids.append(
            set(pa.concat_tables([read_part(r) for r in done_parts(cfg.run_dir, "prompts")])["sample_id"].to_pylist())
        )
    assert ids[0] == ids[1]
    assert not ids[0] & ids[2]


def test_rerun_reuses_and_an_extended_dataset_appends_parts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "b1.jsonl", GOOD[:5])
    cfg = make_cfg(tmp_path, [{"name": "B1", "path": path}])
    assert prepare_datasets(cfg).parts == [0, 1]
    mtimes = {r.part: r.path.stat().st_mtime_ns for r in done_parts(cfg.run_dir, "prompts")}
    assert prepare_datasets(cfg).reused

    extra = [{"messages": [{"role": "user", "content": f"new {i}"}]} for i in range(3)]
    write_jsonl(path, [*extra[:1], *GOOD, *extra[1:]])
    result = prepare_datasets(cfg)
    counts = result.datasets["B1"]
    assert (counts.kept, counts.already_prepared, counts.new) == (9, 5, 4)
    assert result.parts == [0, 1, 2]
    assert {r.part: r.path.stat().st_mtime_ns for r in done_parts(cfg.run_dir, "prompts") if r.part < 2} == mtimes
    ids = [i for r in done_parts(cfg.run_dir, "prompts") for i in read_part(r)["sample_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == 9


def test_bundled_demo_data_has_the_planted_bad_rows(tmp_path: Path) -> None:
    from tests.conftest import DEMO_DATA

    cfg = make_cfg(
        tmp_path,
        [
            {"name": "B1", "path": DEMO_DATA / "demo_b1.jsonl"},
            {"name": "B3", "path": DEMO_DATA / "demo_b3.parquet", "shape": "sharegpt"},
        ],
        per_shard=16,
    )
    result = prepare_datasets(cfg)
    assert result.datasets["B1"].quarantined == 7
    assert result.datasets["B1"].duplicates == 1
    assert result.datasets["B3"].quarantined == 2
    assert result.datasets["B1"].kept == 48
    assert result.datasets["B3"].kept == 32


def test_samples_per_prompt_adds_samples_and_never_renames_the_first(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "b1.jsonl", GOOD)
    cfg = make_cfg(tmp_path, [{"name": "B1", "path": path}], per_shard=100)
    prepare_datasets(cfg)
    one = pa.concat_tables([read_part(r) for r in done_parts(cfg.run_dir, "prompts")])
    assert one["sample_id"].to_pylist() == one["prompt_id"].to_pylist()
    assert set(one["sample_index"].to_pylist()) == {0}

    three = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"samples_per_prompt": 3})})
    result = prepare_datasets(three)
    assert result.datasets["B1"].new == 12 and result.datasets["B1"].already_prepared == 6
    table = pa.concat_tables([read_part(r) for r in done_parts(cfg.run_dir, "prompts")])
    assert table.num_rows == 18 and len(set(table["sample_id"].to_pylist())) == 18
    by_prompt: dict[str, list[int]] = {}
    for row in table.select(["prompt_id", "sample_index"]).to_pylist():
        by_prompt.setdefault(row["prompt_id"], []).append(row["sample_index"])
    assert len(by_prompt) == 6 and all(sorted(v) == [0, 1, 2] for v in by_prompt.values())
    assert set(one["sample_id"].to_pylist()) <= set(table["sample_id"].to_pylist())
    assert prepare_datasets(three).reused


def test_a_line_that_is_not_utf8_is_quarantined_not_replaced(tmp_path: Path) -> None:
    """A Latin-1 "é" was read as U+FFFD and sent: the prompt held text nobody wrote. A UTF-8 byte-order mark on the
    first line is not a bad row."""
    path = tmp_path / "mixed.jsonl"
    good = json.dumps(GOOD[0]).encode()
    latin1 = b'{"messages": [{"role": "user", "content": "caf\xe9 au lait?"}]}'
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + latin1 + b"\n" + json.dumps(GOOD[1]).encode() + b"\n")
    result = prepare_datasets(make_cfg(tmp_path, [{"name": "U", "path": path}]))
    counts = result.datasets["U"]
    assert (counts.rows_read, counts.kept, counts.quarantined) == (3, 2, 1)
    [record] = [json.loads(line) for line in result.quarantine_path.read_text().splitlines()]
    assert record["source_row"] == 1 and record["reason"] == "not UTF-8: byte 0xe9 at byte 47"
    table = pa.concat_tables([read_part(r) for r in done_parts(tmp_path / "run", "prompts")])
    assert "\ufffd" not in json.dumps(table.to_pylist(), ensure_ascii=False)


def test_an_empty_system_turn_is_left_out_and_counted_not_quarantined(tmp_path: Path) -> None:
    """ShareGPT exports put `{"from": "system", "value": ""}` on every row; quarantining those lost whole datasets."""
    rows = [
        {"conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "hello"}]},
        {"messages": [{"role": "system", "content": "  \n"}, {"role": "user", "content": "bye"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]},
        {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}]},
    ]
    cfg = make_cfg(tmp_path, [{"name": "S", "path": write_jsonl(tmp_path / "s.jsonl", rows)}])
    result = prepare_datasets(cfg)

    counts = result.datasets["S"]
    assert (counts.kept, counts.quarantined, counts.empty_system_dropped) == (3, 1, 2)
    table = pa.concat_tables([read_part(r) for r in done_parts(cfg.run_dir, "prompts")])
    assert table["messages"].to_pylist() == [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "bye"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}],
    ]
    reason = json.loads(result.quarantine_path.read_text())["reason"]
    assert reason == "turn 1 (user) has empty content"


def test_a_part_whose_marker_is_gone_is_marked_again_not_prepared_twice(tmp_path: Path) -> None:
    """A prompts part without its marker (deleted by hand, or a crash between the part's rename and its marker):
    its samples were prepared again into a new part, then bought twice and duplicated in every stage and export.
    Now a readable one is marked again with the same rows and number; a part that is gone or does not read, marker
    or not, is prepared again from the dataset under its own number."""
    path = write_jsonl(tmp_path / "b1.jsonl", GOOD)
    cfg = make_cfg(tmp_path, [{"name": "B1", "path": path}], per_shard=2)
    assert prepare_datasets(cfg).parts == [0, 1, 2]
    middle = PartRef(cfg.run_dir, "prompts", 1)
    fingerprint_before = json.loads(middle.marker.read_text())["fingerprint"]
    rows_before = read_part(middle)

    middle.marker.unlink()
    result = prepare_datasets(cfg)
    assert result.parts == [0, 1, 2] and result.datasets["B1"].new == 0
    assert json.loads(middle.marker.read_text())["fingerprint"] == fingerprint_before
    assert read_part(middle).equals(rows_before)

    whole = middle.path.read_bytes()
    damages = {
        "unmarked and cut short": lambda: (middle.marker.unlink(), middle.path.write_bytes(whole[:100])),
        "file deleted": lambda: middle.path.unlink(),
        "file cut short": lambda: middle.path.write_bytes(whole[:100]),
        "same size, overwritten": lambda: middle.path.write_bytes(bytes(len(whole))),
    }
    for name, damage in damages.items():
        damage()
        result = prepare_datasets(cfg)
        # The samples it held are prepared again from the dataset into the same number: the responses and later
        # parts of that number still hold them, so nothing is bought twice or duplicated.
        assert result.datasets["B1"].new == 2 and result.parts == [0, 1, 2], name
        assert json.loads(middle.marker.read_text())["fingerprint"] == fingerprint_before, name
        assert read_part(middle).equals(rows_before), name
        ids = [i for r in done_parts(cfg.run_dir, "prompts") for i in read_part(r)["sample_id"].to_pylist()]
        assert len(ids) == len(set(ids)) == 6, name


def test_a_missing_dataset_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    """A deployment run (no CLI pre-flight) failed with a bare FileNotFoundError naming neither the dataset nor the
    setting, and its traceback twice in the log (an independent Prefect probe)."""
    import pytest

    from tasks.common.errors import ConfigError

    cfg = make_cfg(tmp_path, [{"name": "B1", "path": tmp_path / "nope.jsonl"}])
    with pytest.raises(ConfigError, match=r"dataset B1: .*nope.jsonl does not exist; fix datasets\[0\].path"):
        prepare_datasets(cfg)
