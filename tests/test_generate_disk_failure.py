"""The run directory's disk failing mid-run (EIO, then a disk that is back after a remount): generate stops buying,
writes the answers in flight and its last spend records to the spill directory, and the rerun takes them back, so
no answer is bought twice and the ledger equals the bill. On a real ext4 file system on a loop device, shut down
with the kernel's own ioctl (`EXT4_IOC_SHUTDOWN`, what `xfs_io -c shutdown` sends): every later read, write and
fsync fails with EIO, and what was written but not yet committed to the file system's journal is lost, as when a
device dies. Needs root and a loop device (CI and the dev machines have both); skipped otherwise."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.artifact_store import RunStore
from tasks.common.shards import done_parts, read_part
from tasks.generate.disk_guard import DiskGuard
from tasks.generate.journal import AppendLog, encode_frame, read_records
from tasks.generate.ledger import SpendLedger
from tasks.generate.spill import spill_folder
from tests.conftest import REPO, run_main
from tests.test_generate_disk_full import disk_test_config, ledger_sent, stopped_by_a_disk_fault
from tests.test_generate_money import billed, check_ledger_against_provider, write_dataset

PROMPTS = 240
IN_FLIGHT = 48
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
GOING_NOLOGFLUSH = 2
"""Stop at once without committing the file system's journal: writes since its last commit are lost."""


class DyingDisk:
    def __init__(self, image: Path, mount: Path) -> None:
        self.image, self.mount = image, mount

    def die(self) -> None:
        fd = os.open(self.mount, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", GOING_NOLOGFLUSH))
        finally:
            os.close(fd)

    def back(self) -> None:
        """The disk returns: unmounted and mounted again (ext4 replays its journal)."""
        subprocess.run(["umount", str(self.mount)], check=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mount)], check=True)


@pytest.fixture()
def dying_disk(tmp_path: Path) -> Iterator[DyingDisk]:
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("mount", "mkfs.ext4", "losetup")):
        pytest.skip("a loop-mounted ext4 file system needs root, mount and mkfs.ext4")
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    mount.mkdir()
    with image.open("wb") as fh:
        fh.truncate(64 * 1024**2)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    mounted = made.returncode == 0 and (
        subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True).returncode == 0
    )
    if not mounted:
        pytest.skip(f"cannot mount a loop device here: {made.stderr.strip()}")
    try:
        yield DyingDisk(image, mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def test_a_failed_disk_spills_the_answers_in_flight_and_the_rerun_buys_each_once(
    dying_disk: DyingDisk, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk dies while 48 requests are in flight: one line, exit 2; the answers and the spend records the
    disk lost are in the spill folder; once the disk is back the rerun takes them back and sends only what was
    never answered, and the ledger equals the simulator's bill. Before: an internal error (exit 1), the answers in
    flight bought again by the rerun (209 of 3,000 at 200 in flight), and the billed requests whose `sent` records
    died with the page cache (27) in no ledger, so the directory counted less than the bill."""
    data = tmp_path / "dying.jsonl"
    write_dataset(data, PROMPTS, tag="dying")
    run_dir = dying_disk.mount / "run"
    spill_root = tmp_path / "spill"
    sim_config = SimConfig(seed=7, latency_lognormal=(math.log(0.4), 0.3), reasoning_words=(20, 60))
    with SimulatorServer(tokenizer_dir, sim_config) as sim:
        config = disk_test_config(
            tmp_path / "config.yaml", run_dir, data, sim.base_url, tokenizer_dir, spill_dir=str(spill_root)
        )
        line = stopped_by_a_disk_fault(config, run_dir, PROMPTS // 4, dying_disk.die)
        folder = spill_folder(run_dir, spill_root)
        assert line.startswith(f"error: the disk holding {run_dir} failed ([Errno 5] "), line
        found = re.search(r"waited for the (\d+) requests in flight then .* the (\d+) answers not yet in a ", line)
        assert found is not None and str(folder) in line, line
        in_flight, spilled = int(found.group(1)), int(found.group(2))
        assert 0 < in_flight <= IN_FLIGHT and spilled >= in_flight
        billed_first = len(billed(sim))
        segments = [p.name for p in folder.rglob("*.spill.log")]
        assert any(n.startswith("ledger-") for n in segments) and any(n.startswith("journal-") for n in segments)

        dying_disk.back()
        on_disk = ledger_sent(run_dir)
        status = run_main(capsys, "status", str(run_dir), "--config", str(config))
        assert f"spilled: {len(segments)} log segments" in status.stdout and str(folder) in status.stdout, status
        second = run_main(capsys, "generate", str(config), "--no-progress")
        assert second.returncode == 0, second.stdout + second.stderr
        assert f"took back {len(segments)} log segments" in second.stderr, second.stderr
        total = json.loads(second.stdout.strip().splitlines()[-1])
        print(f"first run: {billed_first} billed, {in_flight} in flight at the failure, {spilled} answers spilled")
        print(f"sent records on the disk once it was back: {on_disk}; rerun sent {total['requests_sent']}")
        assert total["requests_sent"] == PROMPTS - billed_first, "an answer paid for in the first run was bought again"
        assert not folder.exists(), "the spill folder is emptied once taken back"
        ledger = check_ledger_against_provider(run_dir, sim)
        totals = ledger.totals()
        assert (totals.attempts, totals.settled_attempts, totals.pending_attempts) == (PROMPTS, 0, 0)
        assert totals.billed_usd == pytest.approx(sum(r["cost_usd"] for r in billed(sim)))
        rows = [row for ref in done_parts(run_dir, "responses") for row in read_part(ref).to_pylist()]
        assert len(rows) == PROMPTS and {row["status"] for row in rows} == {"done"}
        assert len({row["sample_id"] for row in rows}) == PROMPTS

        # A spill with nothing left to send (the disk failed as the ledger wrote its last records): still taken back.
        late = {"k": "s", "a": "late:0", "id": rows[0]["sample_id"], "d": "dying", "p": 0, "w": 0.01, "t": time.time()}
        ended = {"k": "b", "a": "late:0", "o": "answered", "c": 0.002, "g": "gen-late", "r": None}
        segment = folder / "spend" / "ledger-late.spill.log"
        segment.parent.mkdir(parents=True)
        segment.write_bytes(encode_frame(late) + encode_frame(ended))
        third = run_main(capsys, "generate", str(config), "--no-progress")
        assert third.returncode == 0 and "took back 1 log segment" in third.stderr, third.stdout + third.stderr
        after = SpendLedger.load(run_dir).totals()
        assert (after.attempts, after.billed_usd) == (PROMPTS + 1, pytest.approx(totals.billed_usd + 0.002))


def _records_after_death(dying_disk: DyingDisk, write: Callable[[AppendLog], None]) -> tuple[int, list[object]]:
    guard = DiskGuard(dying_disk.mount, 0)
    log = AppendLog(dying_disk.mount / "journal.log", group_commit_s=60, on_write_error=guard.write_failed)
    write(log)
    dying_disk.die()
    target = dying_disk.mount.parent / "spilled" / "journal.spill.log"
    count = log.spill_to(target)
    return count, list(read_records(target))


def test_spill_holds_what_the_disk_may_have_lost_and_what_it_refused(dying_disk: DyingDisk) -> None:
    """Frames written since the last fsync that succeeded (lost with a dying disk's page cache) and records
    submitted after it failed both reach the spill segment, in order; fsynced ones do not."""
    late = [{"n": i, "pad": "z" * 300} for i in range(50)]

    def write(log: AppendLog) -> None:
        log.write_now({"n": -1})
        log.flush()
        log.write_now({"n": -2})
        for record in late:
            log.submit(record)

    count, records = _records_after_death(dying_disk, write)
    assert records == [{"n": -2}, *late] and count == len(records)


@pytest.mark.slow  # a second end-to-end run, two hosts: make test-long
def test_a_failed_disk_on_one_host_costs_the_next_host_nothing(
    dying_disk: DyingDisk, tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path
) -> None:
    """With a run store, host a's disk dies mid-generate: its spill goes to the store too, so host b (another
    machine: its own run directory and spill folder) pulls it, buys none of host a's answers again, and holds
    every attempt host a made at its billed cost. Without the spill, host b bought again what host a received
    after its last push (one commit interval) and the answers then in flight."""
    from tasks.common.shards import PartRef
    from tests.test_generate import write_prompts
    from tests.test_store_sync import HOST, run_host

    sim.update_config(latency_s=0.3)
    url = f"file://{tmp_path / 'bucket'}"
    configs = {}
    for name, run_dir in (("a", dying_disk.mount / "run1"), ("b", tmp_path / "b" / "run1")):
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(
            yaml.safe_dump(
                {
                    "run_dir": str(run_dir),
                    "datasets": [{"name": "ds", "path": str(tokenizer_dir)}],
                    "endpoint": {
                        "base_url": sim.base_url,
                        "model": "sim/deepseek-v4-sim",
                        "max_in_flight": 8,
                        "commit_every_s": 0.25,
                        "spill_dir": str(tmp_path / f"spill-{name}"),
                    },
                    "tokenizer": {"path": str(tokenizer_dir)},
                }
            )
        )
    a = RunStore(url, dying_disk.mount / "run1")
    for part in range(2):
        write_prompts(a.local_run_dir, part, 30, "dying-host")
        a.push_part(PartRef(a.local_run_dir, "prompts", part))
    first = len(billed(sim))
    host_a = subprocess.Popen(
        [sys.executable, "-c", HOST, str(configs["a"]), url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while ledger_sent(a.local_run_dir) < 20:
        assert host_a.poll() is None and time.monotonic() < deadline, host_a.communicate()
        time.sleep(0.02)
    dying_disk.die()
    _, err = host_a.communicate(timeout=300)
    assert host_a.returncode != 0 and "DiskFailedError: the disk holding" in err.strip().splitlines()[-1], err

    run_host(str(configs["b"]), url)
    records = billed(sim)[first:]
    by_key: dict[str, int] = {}
    for record in records:
        by_key[record["key"]] = by_key.get(record["key"], 0) + 1
    assert len(by_key) == 60 and max(by_key.values()) == 1, "an answer host a paid for was bought again"
    ledger = SpendLedger.load(tmp_path / "b" / "run1")
    known = {a.generation_id: a.billed_usd for a in ledger.attempts.values() if a.generation_id}
    wrong = [r for r in records if known.get(r["id"]) != pytest.approx(r["cost_usd"], abs=1e-12)]
    assert not wrong, f"billed generations the ledger lacks or counts wrong: {wrong[:5]}"
    assert ledger.totals().pending_attempts == 0
    rows = [row for ref in done_parts(tmp_path / "b" / "run1", "responses") for row in read_part(ref).to_pylist()]
    assert len(rows) == len({row["sample_id"] for row in rows}) == 60


def test_the_line_blames_the_disk_only_for_a_disk_errno(tmp_path: Path) -> None:
    """Any failed write stops the run (an answer bought then could not be kept), but only a failing disk's errno
    is told as the disk failing; the first disk error wins over a full disk that came before it."""
    import errno

    guard = DiskGuard(tmp_path, 0)
    assert guard.write_failed(OSError(errno.EMFILE, "Too many open files"))
    assert guard.stopped and guard.cause == "failed"
    assert guard.what_failed(tmp_path) == f"a write to {tmp_path} failed"
    full = DiskGuard(tmp_path, 0)
    full.write_failed(OSError(errno.ENOSPC, "No space left on device"))
    assert full.cause == "full"
    full.write_failed(OSError(errno.EIO, "Input/output error"))
    assert full.cause == "failed" and full.what_failed(tmp_path) == f"the disk holding {tmp_path} failed"


def test_after_a_failed_fsync_no_later_fsync_drops_what_it_may_have_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux may mark the pages of a failed fsync clean without writing them, and a later fsync then succeeds: the
    frames written before the failure must still reach a spill. (The one fault injected here rather than made:
    a file system whose fsync fails once and then works again cannot be had on a loop device.)"""
    import errno

    real_fsync = os.fsync
    failures = [OSError(errno.EIO, "Input/output error")]

    def fsync_failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    log = AppendLog(tmp_path / "journal.log", group_commit_s=60, on_write_error=DiskGuard(tmp_path, 0).write_failed)
    log.write_now({"n": 1})
    monkeypatch.setattr("tasks.generate.journal.os.fsync", fsync_failing_once)
    with pytest.raises(OSError):
        log.flush()
    log.write_now({"n": 2})
    log.flush()
    assert log.spill_to(tmp_path / "spill" / "journal.spill.log") == 2
    assert list(read_records(tmp_path / "spill" / "journal.spill.log")) == [{"n": 1}, {"n": 2}]
