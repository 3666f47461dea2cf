"""Loading a run directory's spend ledger: records parsed 4,096 at a time as one JSON array against one by one.

Every rerun, `estimate`, `status` and the generate stage's start and end load the whole ledger (one record set per
request attempt ever sent), so at a million samples its load is seconds per command. This writes a ledger of N
attempts (a `s`, `g` and `b` record each, in four segments, as four runs would) with the real `LedgerWriter`, then
loads it alternately with `tasks.generate.journal.read_records` and with the reader it replaced (the same framing
and checks, `json.loads` per record), and checks both give the same records and the same `SpendTotals`.

Prints one JSON line: the median seconds of each over the rounds and their ratio. ~1 minute on 2 cores:
    python bench/ledger_load.py [--attempts 300000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.generate import journal, ledger  # noqa: E402
from tasks.generate.ledger import LedgerWriter, SpendLedger  # noqa: E402


def one_by_one(path: Path) -> Iterator[Any]:
    """The reader before batching: the same framing and checks (`journal._payloads`), `json.loads` per record."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for payload in journal._payloads(data):
        try:
            yield json.loads(payload)
        except ValueError:
            return


def write_ledger(run_dir: Path, attempts: int, segments: int = 4) -> None:
    for seg in range(segments):
        writer = LedgerWriter(run_dir, 0.2)
        for i in range(attempts // segments):
            gen = f"gen-{seg}-{i:09d}-8f3a9c2e"
            uid = writer.sent(f"{seg:02d}{i:030x}", "chat", i // 1000, 0.0123, 600.0)
            writer.generation(uid, gen)
            writer.ended(uid, "answered", 0.00321, gen, None)
        writer.close()


def timed_load(run_dir: Path, reader: Any) -> tuple[float, SpendLedger]:
    """`SpendLedger.load` with `reader` as the ledger module's record reader."""
    kept = ledger.read_records
    ledger.read_records = reader
    try:
        started = time.perf_counter()
        loaded = SpendLedger.load(run_dir)
        return time.perf_counter() - started, loaded
    finally:
        ledger.read_records = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        write_ledger(run_dir, args.attempts)
        size = sum(p.stat().st_size for p in (run_dir / "spend").glob("*.log"))
        for path in sorted((run_dir / "spend").glob("*.log")):
            assert list(journal.read_records(path)) == list(one_by_one(path)), path
        times: dict[str, list[float]] = {"batched": [], "one_by_one": []}
        totals: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for name, reader in (("one_by_one", one_by_one), ("batched", journal.read_records)):
                seconds, loaded = timed_load(run_dir, reader)
                times[name].append(seconds)
                totals[name] = loaded.totals().to_dict()
        assert totals["batched"] == totals["one_by_one"]
        old, new = statistics.median(times["one_by_one"]), statistics.median(times["batched"])
        print(
            json.dumps(
                {
                    "attempts": args.attempts,
                    "ledger_mb": round(size / 1e6, 1),
                    "one_by_one_s": round(old, 3),
                    "batched_s": round(new, 3),
                    "speedup": round(old / new, 2),
                }
            )
        )


if __name__ == "__main__":
    main()
