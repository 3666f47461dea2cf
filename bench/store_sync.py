"""What mirroring the answer journal to an S3 store costs per commit interval, as the log grows.

An S3-compatible server (moto, in its own process on 127.0.0.1) is the store. A journal grows by `--answers`
answers of `--answer-bytes` each per interval (the README's 1,190 bytes per answer; 1,000 answers is half a
second at 2,000 in flight), for `--intervals` intervals. After each interval, `LogMirror.push` uploads what the
journal gained as one piece. Side by side, at a few sizes along the way, the same journal is uploaded whole (what
every interval would cost if the log were re-sent each time, as `RunStore.push_file` does): time and bytes per
interval for both. Then a host that died is recovered: pulling its journal from its pieces against pulling the
same bytes as one object.

    python bench/store_sync.py [--intervals 60 --answers 1000 --answer-bytes 1190]

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.common.artifact_store import RunStore  # noqa: E402
from tasks.generate.chunks import journal_dir  # noqa: E402
from tasks.generate.journal import AppendLog  # noqa: E402
from tasks.generate.store_sync import JOURNALS, LogMirror  # noqa: E402

BUCKET = "bench"


def start_s3() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "moto server did not start"
        time.sleep(0.2)
    httpx.put(f"{url}/{BUCKET}", timeout=10).raise_for_status()
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", type=int, default=60)
    parser.add_argument("--answers", type=int, default=1000, help="answers journaled per interval")
    parser.add_argument("--answer-bytes", type=int, default=1190)
    parser.add_argument(
        "--whole-every",
        type=int,
        default=15,
        help="upload the whole log every N intervals (and after the last)",
    )
    args = parser.parse_args()

    proc, s3_url = start_s3()
    credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(credentials, AWS_ENDPOINT_URL=s3_url)
    root = Path(tempfile.mkdtemp(prefix="store-sync-bench-"))
    try:
        store = RunStore(f"s3://{BUCKET}/runs", root / "host-a" / "run")
        mirror = LogMirror(store, every_s=3600)
        journal = AppendLog(journal_dir(store.local_run_dir) / "journal-0-1.log", group_commit_s=3600)
        row = {"sample_id": "", "status": "done", "content": "x" * max(0, args.answer_bytes - 80)}
        piece_s: list[float] = []
        whole: list[dict[str, float]] = []
        n = 0
        for interval in range(1, args.intervals + 1):
            for _ in range(args.answers):
                journal.submit({"p": 0, "r": {**row, "sample_id": f"s{n}"}})
                n += 1
            journal.flush()
            started = time.perf_counter()
            mirror.push()
            piece_s.append(time.perf_counter() - started)
            if interval % args.whole_every == 0 or interval == args.intervals:
                size = journal.path.stat().st_size
                started = time.perf_counter()
                store.push_file(journal.path, f"bench-whole/{journal.path.name}")
                whole.append({"log_mb": round(size / 1e6, 1), "seconds": time.perf_counter() - started})
        journal.close()
        size = journal.path.stat().st_size
        interval_bytes = size / args.intervals

        folder, pattern = JOURNALS
        pieces_view = store.list_logs(folder, pattern)["journal-0-1.log"]
        started = time.perf_counter()
        with open(os.devnull, "wb") as sink:
            pulled = store.read_log(folder, "journal-0-1.log", pieces_view, sink)
        pull_pieces_s = time.perf_counter() - started
        started = time.perf_counter()
        whole_bytes = store.fs.cat_file(store._remote(f"bench-whole/{journal.path.name}"))
        pull_whole_s = time.perf_counter() - started
        assert pulled == size and len(whole_bytes) == size

        last_whole = whole[-1]
        print(
            json.dumps(
                {
                    "intervals": args.intervals,
                    "answers_per_interval": args.answers,
                    "interval_mb": round(interval_bytes / 1e6, 3),
                    "final_log_mb": round(size / 1e6, 1),
                    "uploaded_mb": round(mirror.stats.bytes / 1e6, 1),
                    "piece_push_s_median": round(statistics.median(piece_s), 4),
                    "piece_push_s_last": round(piece_s[-1], 4),
                    "piece_push_s_first_quarter": round(statistics.median(piece_s[: max(1, len(piece_s) // 4)]), 4),
                    "piece_push_s_last_quarter": round(statistics.median(piece_s[-max(1, len(piece_s) // 4) :]), 4),
                    "whole_push_s": [{"log_mb": w["log_mb"], "seconds": round(w["seconds"], 4)} for w in whole],
                    "ratio_interval_cost_piece_vs_whole_at_final": round(piece_s[-1] / last_whole["seconds"], 4),
                    "pull_pieces_s": round(pull_pieces_s, 3),
                    "pull_whole_s": round(pull_whole_s, 3),
                    "pieces": len(pieces_view.pieces),
                }
            )
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
