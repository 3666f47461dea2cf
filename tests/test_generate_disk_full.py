"""The run directory's disk filling mid-run: generate stops buying, keeps every answer already paid for, and a
rerun after space is freed buys each sample once. On a real small file system (a tmpfs this test mounts: it needs
root, as CI and the dev machines have; skipped otherwise), filled by another writer while requests are in flight,
as a GPU worker's hidden states fill a shared disk."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from flows.exit_codes import ExitCode
from tasks.common.shards import done_parts, read_part
from tasks.generate.disk_guard import RESERVE_NAME, DiskGuard
from tasks.generate.journal import AppendLog, read_records, whole_frames_length
from tasks.generate.ledger import LEDGER_DIR, SpendLedger
from tasks.generate.spill import spill_folder
from tests.conftest import REPO, run_main
from tests.test_generate_money import billed, check_ledger_against_provider, write_dataset

PROMPTS = 400
IN_FLIGHT = 48
DISK_MIB = 24
RESERVE_MIB = 2


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs: a disk that really fills (ENOSPC from the kernel, short writes included)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path, leave_bytes: int = 0) -> int:
    """Write `path` until the disk refuses (or only `leave_bytes` are left); returns the bytes written."""
    written = 0
    block = b"\0" * 65536
    with path.open("wb", buffering=0) as fh:
        while True:
            room = shutil.disk_usage(path.parent).free - leave_bytes
            if room <= 0:
                return written
            try:
                written += fh.write(block[: min(len(block), room)])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return written


def ledger_sent(run_dir: Path) -> int:
    return sum(
        1 for seg in (run_dir / LEDGER_DIR).glob("ledger-*.log") for rec in read_records(seg) if rec.get("k") == "s"
    )


def disk_test_config(
    path: Path, run_dir: Path, data: Path, base_url: str, tokenizer_dir: Path, **endpoint: object
) -> Path:
    """The disk tests' generate config: `IN_FLIGHT` requests, a cap, commits every 0.5 s; `endpoint` adds to it."""
    path.write_text(
        yaml.safe_dump(
            {
                "run_dir": str(run_dir),
                "samples_per_shard": 100,
                "datasets": [{"name": data.stem, "path": str(data)}],
                "endpoint": {
                    "base_url": base_url,
                    "model": "sim/deepseek-v4-sim",
                    "max_in_flight": IN_FLIGHT,
                    "commit_every_s": 0.5,
                    "price_prompt_usd_per_mtok": 0.6,
                    "price_completion_usd_per_mtok": 2.5,
                    "max_cost_usd": 5.0,
                    **endpoint,
                },
                "sampling": {"max_tokens": 512},
                "tokenizer": {"path": str(tokenizer_dir)},
            }
        )
    )
    return path


def stopped_by_a_disk_fault(config: Path, run_dir: Path, sent: int, fault: Callable[[], object]) -> str:
    """`generate` in its own process, `fault()` once the ledger shows `sent` requests sent: the run must end with
    exit 2 and no traceback. Returns its last stderr line."""
    cmd = [sys.executable, "-m", "flows.cli", "generate", str(config), "--no-progress"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while ledger_sent(run_dir) < sent:
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    fault()
    out, err = first.communicate(timeout=300)
    assert first.returncode == ExitCode.USER, out + err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_full_disk_keeps_answers_in_flight_and_rerun_buys_each_once(
    small_disk: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another writer fills the disk while 48 requests are in flight: the run stops with one line and exit 2,
    the answers that were in flight are journaled into the freed reserve, and after space is freed the rerun
    sends only what was never answered. Before, the error cancelled the requests in flight: billed, lost, and
    bought again (200 of 3,000 at 200 in flight, measured)."""
    data = tmp_path / "disk.jsonl"
    write_dataset(data, PROMPTS, tag="disk")
    run_dir = small_disk / "run"
    sim_config = SimConfig(seed=5, latency_lognormal=(math.log(0.3), 0.3), reasoning_words=(20, 60))
    with SimulatorServer(tokenizer_dir, sim_config) as sim:
        config = disk_test_config(
            tmp_path / "config.yaml",
            run_dir,
            data,
            sim.base_url,
            tokenizer_dir,
            progress_every_s=0.5,
            disk_reserve_mib=RESERVE_MIB,
        )
        ballast = small_disk / "hidden-states.bin"
        line = stopped_by_a_disk_fault(config, run_dir, PROMPTS // 4, lambda: fill(ballast))
        assert line.startswith(f"error: the disk holding {run_dir} filled"), line
        found = re.search(r"waited for the (\d+) requests in flight then .* kept every answer: the (\d+) ", line)
        assert found is not None, line
        in_flight, kept = int(found.group(1)), int(found.group(2))
        assert not (run_dir / RESERVE_NAME).exists(), "the reserve is released when the run ends"
        for segment in [*(run_dir / LEDGER_DIR).glob("*.log"), *(run_dir / "responses").glob("_journal/*.log")]:
            data_bytes = segment.read_bytes()
            assert whole_frames_length(data_bytes) == len(data_bytes), f"{segment.name} has a torn frame"
        sent_first = ledger_sent(run_dir)
        assert len(billed(sim)) == sent_first, "every request the ledger shows sent was answered and billed"

        ballast.unlink()
        second = run_main(capsys, "generate", str(config), "--no-progress")
        assert second.returncode == 0, second.stdout + second.stderr
        total = json.loads(second.stdout.strip().splitlines()[-1])
        print(f"first run: {sent_first} sent, {in_flight} in flight at the fill, {kept} answers in the journal only")
        print(f"rerun sent {total['requests_sent']}")
        assert 0 < in_flight <= IN_FLIGHT and kept > 0
        assert total["requests_sent"] == PROMPTS - sent_first, "an answer paid for in the first run was bought again"
        ledger = check_ledger_against_provider(run_dir, sim)
        totals = ledger.totals()
        assert (totals.attempts, totals.settled_attempts, totals.pending_attempts) == (PROMPTS, 0, 0)
        rows = [row for ref in done_parts(run_dir, "responses") for row in read_part(ref).to_pylist()]
        assert len(rows) == PROMPTS and {row["status"] for row in rows} == {"done"}
        assert len({row["sample_id"] for row in rows}) == PROMPTS
    assert SpendLedger.load(run_dir).totals().billed_usd == pytest.approx(sum(r["cost_usd"] for r in billed(sim)))


def test_journal_on_a_full_disk_keeps_every_record_and_leaves_no_torn_frame(small_disk: Path) -> None:
    """A frame cut by the disk filling is cut back (a torn frame mid-segment hides every record after it), the
    records that could not be written are held, and all of them are written, in order, once there is room."""
    guard = DiskGuard(small_disk, 0)
    log = AppendLog(small_disk / "journal.log", group_commit_s=0.05, on_write_error=guard.write_failed)
    log.write_now({"n": -1})
    ballast = small_disk / "ballast"
    fill(ballast, leave_bytes=3000)
    with pytest.raises(OSError) as refused:
        log.write_now({"n": -2, "pad": "x" * 20000})
    assert refused.value.errno == errno.ENOSPC and guard.stopped
    records = [{"n": i, "pad": "y" * 500} for i in range(200)]
    for record in records:
        log.submit(record)
    deadline = time.monotonic() + 30
    while log.unwritten == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.unwritten > 0, "the disk took every record: the test did not fill it"
    data = (small_disk / "journal.log").read_bytes()
    assert whole_frames_length(data) == len(data)
    ballast.unlink()
    while log.unwritten and time.monotonic() < deadline:
        time.sleep(0.05)
    log.close()
    assert list(read_records(small_disk / "journal.log")) == [{"n": -1}, *records]


def test_a_disk_without_room_for_the_reserve_buys_nothing(
    small_disk: Path, tokenizer_dir: Path, tmp_path: Path, server: SimulatorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reserve is claimed before the first request: a disk already too full is one line and exit 2."""
    data = tmp_path / "prompts.jsonl"
    write_dataset(data, 20, tag="full")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_dir": str(small_disk / "run"),
                "datasets": [{"name": "full", "path": str(data)}],
                "endpoint": {"base_url": server.base_url, "model": "sim/deepseek-v4-sim", "disk_reserve_mib": 64},
                "sampling": {"max_tokens": 256},
                "tokenizer": {"path": str(tokenizer_dir)},
            }
        )
    )
    before = len(billed(server))
    done = run_main(capsys, "generate", str(config), "--no-progress")
    assert done.returncode == ExitCode.USER, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the disk holding {small_disk / 'run'} has ") and "nothing was sent" in line
    assert "64 MiB" in line and "endpoint.disk_reserve_mib" in line
    assert len(billed(server)) == before
    assert not (small_disk / "run" / RESERVE_NAME).exists()


@pytest.mark.slow  # a second end-to-end run on a real tmpfs: make test-long
def test_a_full_disk_that_never_makes_room_spills_what_it_holds(
    small_disk: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No reserve and a disk filled to the last byte: the answers in flight cannot be journaled, and once
    `endpoint.outage_abort_s` has passed without room they go to the spill directory instead of being lost (as
    they were: "N could not be written and are lost"); the rerun takes them back and buys each sample once."""
    data = tmp_path / "noroom.jsonl"
    write_dataset(data, PROMPTS, tag="noroom")
    run_dir = small_disk / "run"
    spill_root = tmp_path / "spill"
    sim_config = SimConfig(seed=9, latency_lognormal=(math.log(0.3), 0.3), reasoning_words=(20, 60))
    with SimulatorServer(tokenizer_dir, sim_config) as sim:
        config = disk_test_config(
            tmp_path / "config.yaml",
            run_dir,
            data,
            sim.base_url,
            tokenizer_dir,
            disk_reserve_mib=0,
            outage_abort_s=2,
            spill_dir=str(spill_root),
        )
        ballast = small_disk / "hidden-states.bin"
        line = stopped_by_a_disk_fault(config, run_dir, PROMPTS // 4, lambda: fill(ballast))
        folder = spill_folder(run_dir, spill_root)
        assert line.startswith(f"error: the disk holding {run_dir} filled"), line
        assert "found no room for them (no space reserved" in line and str(folder) in line, line
        billed_first = len(billed(sim))

        ballast.unlink()
        second = run_main(capsys, "generate", str(config), "--no-progress")
        assert second.returncode == 0, second.stdout + second.stderr
        assert "took back" in second.stderr, second.stderr
        total = json.loads(second.stdout.strip().splitlines()[-1])
        assert total["requests_sent"] == PROMPTS - billed_first, "an answer paid for in the first run was bought again"
        totals = check_ledger_against_provider(run_dir, sim).totals()
        assert (totals.attempts, totals.settled_attempts, totals.pending_attempts) == (PROMPTS, 0, 0)
        rows = [row for ref in done_parts(run_dir, "responses") for row in read_part(ref).to_pylist()]
        assert len(rows) == PROMPTS and len({row["sample_id"] for row in rows}) == PROMPTS
