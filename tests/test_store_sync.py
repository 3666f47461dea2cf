"""The spend ledger and the answer journal mirrored to a run store while they grow (tasks/generate/store_sync.py):
what one push costs, what another host reads back, what a dead host leaves for the next one, and when a journal
leaves the store. Hosts are local directories sharing a `file://` store, as the RunStore tests do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from endpoint_sim.server import SimulatorServer
from tasks.common.artifact_store import PIECES_DIR, RemoteLog, RunStore
from tasks.generate.chunks import chunk_dir, journal_dir, journal_paths, journal_rows
from tasks.generate.journal import AppendLog, encode_frame, read_records, whole_frames_length
from tasks.generate.ledger import LEDGER_DIR, LedgerWriter, SpendLedger, ledger_dir
from tasks.generate.store_sync import LogMirror


def host(tmp_path: Path, name: str) -> RunStore:
    return RunStore(f"file://{tmp_path / 'bucket'}", tmp_path / name / "run1")


def test_whole_frames_length_stops_before_a_torn_or_corrupt_frame() -> None:
    frames = [encode_frame({"i": i, "pad": "x" * i}) for i in range(4)]
    data = b"".join(frames)
    assert whole_frames_length(data) == len(data)
    assert whole_frames_length(data[:-1]) == len(data) - len(frames[-1])
    assert whole_frames_length(data[: len(frames[0]) + 5]) == len(frames[0])
    corrupt = bytearray(data)
    corrupt[len(frames[0]) + 9] ^= 0xFF
    assert whole_frames_length(bytes(corrupt)) == len(frames[0])


def test_remote_log_joins_the_whole_copy_and_the_pieces_that_continue_it() -> None:
    assert RemoteLog(100, [(100, 150), (150, 190)]).size == 190
    assert RemoteLog(0, [(0, 40), (0, 90), (40, 60), (90, 95)]).chain() == [(0, 40), (0, 90), (90, 95)]
    assert RemoteLog(0, [(0, 40), (50, 60)]).size == 40, "a gap ends what a reader can have"
    assert RemoteLog(120, [(0, 40), (40, 100)]).size == 120, "pieces the whole copy covers add nothing"


def test_each_push_uploads_only_what_the_log_gained_and_never_a_torn_frame(tmp_path: Path) -> None:
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    mirror = LogMirror(a, every_s=60)
    journal = AppendLog(journal_dir(a.local_run_dir) / "journal-1-1.log", group_commit_s=0.2)
    for i in range(5):
        for j in range(20):
            journal.submit({"p": 0, "r": {"sample_id": f"s{i}-{j}", "status": "done", "text": "y" * 200}})
        journal.flush()
        mirror.push()
    torn = encode_frame({"p": 0, "r": {"sample_id": "torn", "status": "done"}})
    with journal.path.open("ab") as fh:  # a write caught half-way: only whole frames may leave
        fh.write(torn[:7])
    mirror.push()
    whole = journal.path.stat().st_size - 7
    assert mirror.stats.bytes == whole, "each byte was uploaded once, the torn frame not at all"
    assert (mirror.stats.pushes, mirror.stats.pieces) == (5, 5)
    with journal.path.open("ab") as fh:
        fh.write(torn[7:])
    mirror.push()
    assert mirror.stats.bytes == journal.path.stat().st_size and mirror.stats.pieces == 6
    journal.close()

    logs = b.list_logs("responses/_journal", "journal-*.log")
    assert list(logs) == ["journal-1-1.log"] and len(logs["journal-1-1.log"].pieces) == 6
    assert LogMirror(b, every_s=60).pull() == {"ledgers": 0, "journals": 1}
    assert (journal_dir(b.local_run_dir) / "journal-1-1.log").read_bytes() == journal.path.read_bytes()
    assert len(journal_rows(b.local_run_dir)[0]) == 101


def test_a_dead_hosts_spend_counts_against_the_cap_on_the_next_host(tmp_path: Path) -> None:
    """Host a dies after a push: its settled and its pending attempts reach host b's ledger; host b's own
    earlier segment is kept, and a copy it holds whole is not fetched again."""
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    writer = LedgerWriter(a.local_run_dir, group_commit_s=0.2)
    writer.ended(writer.sent("s1", "ds", 0, 0.5), "answered", 0.25, "gen-1", None)
    writer.sent("s2", "ds", 0, 0.5)  # in flight when the host died
    writer.log.flush()
    LogMirror(a, every_s=60).push()  # the last interval's push; the host dies before `closed`
    writer.sent("s3", "ds", 0, 0.5)  # after the last push: lost with the host (at most one interval)

    own = LedgerWriter(b.local_run_dir, group_commit_s=0.2)
    own.sent("s4", "ds", 0, 0.125)
    own.close()
    mirror = LogMirror(b, every_s=60)
    assert mirror.pull() == {"ledgers": 1, "journals": 0}
    totals = SpendLedger.load(b.local_run_dir).totals()
    assert (totals.billed_usd, totals.pending_usd, totals.attempts) == (0.25, 0.625, 3)
    assert mirror.pull() == {"ledgers": 0, "journals": 0}
    writer.close()


def test_a_closed_ledger_segment_becomes_one_object_read_back_the_same(tmp_path: Path) -> None:
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    mirror = LogMirror(a, every_s=60)
    writer = LedgerWriter(a.local_run_dir, group_commit_s=0.2)
    for i in range(3):
        writer.ended(writer.sent(f"s{i}", "ds", 0, 0.5), "answered", 0.1, f"gen-{i}", None)
        writer.log.flush()
        mirror.push()
    writer.close()
    mirror.closed()
    name = writer.log.path.name
    assert b.list_logs(LEDGER_DIR, "ledger-*.log")[name] == RemoteLog(writer.log.path.stat().st_size, [])
    assert not a.fs.find(a._remote(f"{LEDGER_DIR}/{PIECES_DIR}"))
    LogMirror(b, every_s=60).pull()
    assert (ledger_dir(b.local_run_dir) / name).read_bytes() == writer.log.path.read_bytes()


def test_a_journal_leaves_the_store_only_when_its_rows_are_in_finished_parts_here(tmp_path: Path) -> None:
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    journal = AppendLog(journal_dir(a.local_run_dir) / "journal-2-2.log", group_commit_s=0.2)
    journal.submit({"p": 0, "r": {"sample_id": "s1", "status": "done"}})
    journal.close()
    LogMirror(a, every_s=60).push()

    mirror = LogMirror(b, every_s=60)
    assert mirror.pull()["journals"] == 1
    [replayed] = journal_paths(b.local_run_dir)
    chunk = chunk_dir(b.local_run_dir, 0) / "chunk-000000.parquet"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"rows now live here only")
    replayed.unlink()  # the engine put its rows into a chunk: the store's copy is the only one off this host
    assert mirror.drop_replayed_journals() == []
    assert LogMirror(b, every_s=60).pull()["journals"] == 0, "a journal replayed here is not pulled again"
    assert list(b.list_logs("responses/_journal", "journal-*.log")) == ["journal-2-2.log"]

    chunk.unlink()  # the part is finished (and pushed by the caller)
    assert mirror.drop_replayed_journals() == ["journal-2-2.log"]
    assert b.list_logs("responses/_journal", "journal-*.log") == {}
    assert not list(read_records(replayed))


def test_a_push_that_fails_is_retried_from_the_same_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = host(tmp_path, "a")
    mirror = LogMirror(a, every_s=60)
    journal = AppendLog(journal_dir(a.local_run_dir) / "journal-3-3.log", group_commit_s=0.2)
    journal.submit({"p": 0, "r": {"sample_id": "s1", "status": "done"}})
    journal.flush()
    real_put = a.put_piece

    def unreachable(*args: object) -> None:
        raise OSError("store unreachable")

    monkeypatch.setattr(a, "put_piece", unreachable)
    with pytest.raises(OSError):
        mirror.push()
    monkeypatch.setattr(a, "put_piece", real_put)
    journal.submit({"p": 0, "r": {"sample_id": "s2", "status": "done"}})
    journal.close()
    mirror.push()
    logs = a.list_logs("responses/_journal", "journal-*.log")
    assert logs["journal-3-3.log"] == RemoteLog(0, [(0, journal.path.stat().st_size)])


COMMIT_EVERY_S = 0.25
# An answer billed this long before the kill must have reached the store: one commit interval, plus room for a
# busy machine (the pusher thread's upload, a late wake-up).
DURABLE_AFTER_S = COMMIT_EVERY_S + 1.0
HOST = "from tests.test_store_sync import run_host; import sys; run_host(sys.argv[1], sys.argv[2])"


def run_host(config: str, url: str) -> None:
    """One host's generate, as the pipeline's generate stage runs it against a store (flows.pipeline)."""
    from tasks.common.config import load_config
    from tasks.common.shards import done_parts
    from tasks.generate import generate_parts
    from tests.test_generate import MARKERS

    cfg = load_config(Path(config))
    store = RunStore(url, cfg.run_dir)
    store.pull_stage("prompts")
    mirror = LogMirror(store, cfg.endpoint.commit_every_s)
    mirror.pull()
    mirror.start()
    try:
        generate_parts(cfg, done_parts(cfg.run_dir, "prompts"), MARKERS, on_commit=mirror)
    finally:
        mirror.close()


def host_config(tmp_path: Path, name: str, sim: SimulatorServer, tokenizer_dir: Path) -> str:
    config: dict[str, Any] = {
        "run_dir": str(tmp_path / name / "run1"),
        "datasets": [{"name": "ds", "path": str(tokenizer_dir)}],
        "endpoint": {
            "base_url": sim.base_url,
            "model": "sim/deepseek-v4-sim",
            "max_in_flight": 4,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "commit_every_samples": 1000,  # the time interval is the one under test
            "commit_every_s": COMMIT_EVERY_S,
        },
        "tokenizer": {"path": str(tokenizer_dir)},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_host_killed_mid_generate_costs_the_next_host_at_most_one_commit_interval(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path
) -> None:
    """Host a is `kill -9`ed mid-run; host b pulls the store and finishes. Compared with the simulator's own
    billing ledger: no answer billed more than one commit interval before the kill is bought again, and host b's
    spend ledger holds every one of them at its billed cost."""
    from tasks.common.shards import PartRef, done_parts, read_part
    from tests.test_generate import write_prompts

    sim.update_config(latency_s=0.2)
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    for part in range(2):
        write_prompts(a.local_run_dir, part, 30, "mirror")
        a.push_part(PartRef(a.local_run_dir, "prompts", part))
    first = len(sim.billing()["records"])
    log = tmp_path / "host-a.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOST, host_config(tmp_path, "a", sim, tokenizer_dir), a.url],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:  # kill once some answers are older than the durability bound and most are still to come
            records = sim.billing()["records"][first:]
            if len(records) >= 20 and time.monotonic() - records[0]["billed_at"] > DURABLE_AFTER_S + 0.3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        killed_at = time.monotonic()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    run_host(host_config(tmp_path, "b", sim, tokenizer_dir), b.url)

    records = sim.billing()["records"][first:]
    by_key: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_key.setdefault(record["key"], []).append(record)
    durable = [r for r in records if r["billed_at"] < killed_at - DURABLE_AFTER_S]
    bought_again = [rs[0] for rs in by_key.values() if len(rs) > 1]
    assert durable and len(by_key) == 60
    assert all(r["billed_at"] >= killed_at - DURABLE_AFTER_S for r in bought_again), "a durable answer bought again"
    settled = {a.generation_id: a for a in SpendLedger.load(b.local_run_dir).attempts.values() if a.generation_id}
    for record in durable:  # the dead host's attempts, each at what the provider billed for it
        assert settled[record["id"]].counted_usd == pytest.approx(record["cost_usd"], abs=1e-12)
    rows = pa.concat_tables(read_part(ref) for ref in done_parts(b.local_run_dir, "responses")).to_pylist()
    assert len(rows) == len({r["sample_id"] for r in rows}) == 60
    assert all(r["status"] == "done" for r in rows)
    figures = {"billed_before_kill": sum(r["billed_at"] < killed_at for r in records), "durable": len(durable)}
    print(json.dumps({**figures, "bought_again": len(bought_again)}))
