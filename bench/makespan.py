"""Makespan of the real generate stage against the best any scheduler could do with the same requests.

What is measured: the wall time of `tasks.generate.generate_parts` (loading the prompts parts, every request,
chunk commits, part writes: the whole call) for `--requests` prompts spread over `--parts` parts, at
`--concurrency` requests in flight, against the endpoint simulator running in its own process. Latencies are
heavy-tailed (log-normal, `--mu`/`--sigma` in log-seconds), as real reasoning models' are: a few requests take
ten times the median, and a scheduler that lets slots idle behind them (a barrier per part, a window that
refills late, a commit that blocks the event loop) loses exactly here.

The ideal: a zero-overhead scheduler that keeps exactly C requests in flight and starts them in the order the
engine issues them (parts in order, rows in part order), each taking precisely the latency the simulator sleeps
for it (`endpoint_sim.responder.request_latency_s(config, key, attempt)`, a pure function of the request's key).
It is computed with a heap of finish times. The key and attempt of each row come from the simulator's own
generation id ("gen-<attempt>-<key>"), so the ideal uses the very requests the server saw; every row must be
"done" at attempt 1 (no failures are injected), otherwise the run is an error.

`ratio` = measured / ideal: 1.0 means the stage added nothing to the endpoint's own time. The ideal includes
the tail: with sigma 0.6 the slowest of 20,000 requests takes ~45 s and may start late, so the ideal rate over
the whole run (`ideal_req_per_s`) is well below the steady-state rate C / mean latency (`ideal_steady_req_per_s`,
~415 req/s by default). Simulator answers are kept short (a few words) so the simulator stays far below one
core at that rate; its CPU seconds are reported so you can check. The simulator's cache is not pre-warmed:
building one short answer costs ~0.1 ms of simulator CPU (prompt rendering and answer encoding, measured with
the demo tokenizer), so 20,000 distinct answers add ~2 s of simulator CPU spread over a run of over a minute,
far too little to delay any request measurably.

The stage runs in a fresh child process with generous timeouts and the default commit settings; its CPU
seconds, the part of them spent in the cyclic garbage collector, and its peak RSS are reported alongside.
`--profile` prints a cProfile
of the stage to stderr (the profiler slows it, so the ratio of such a run means little).

    python bench/makespan.py            # 20,000 requests, 40 parts, C = 2,000 (about 1.5 minutes)
    python bench/makespan.py --quick    # smoke run: 2,000 requests, 8 parts, C = 200

Human-readable lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import heapq
import io
import math
import os
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from _sim_process import (
    GcTimer,
    SimProcess,
    emit,
    log,
    pipeline_config,
    raise_open_files,
    run_child,
    self_cpu_s,
    self_peak_rss_mib,
    tokenizer_dir,
)

from endpoint_sim.responder import REASONING_CLOSE, SimConfig, request_latency_s
from tasks.common.messages import Message, sample_id
from tasks.common.schemas import PROMPTS
from tasks.common.shards import PartRef, read_part, write_part
from tasks.generate import CompletionMarkers, generate_parts

SCRIPT = Path(__file__).resolve()
MARKERS = CompletionMarkers(reasoning_close=REASONING_CLOSE, end_of_turn="<｜end▁of▁sentence｜>")
DATASET = "bench"
PROFILE_TOP = 30
GENERATION_ID = re.compile(r"gen-(\d+)-([0-9a-f]+)")


def write_prompts(run_dir: Path, requests: int, parts: int) -> list[PartRef]:
    """`requests` distinct one-turn prompts over `parts` parts of (nearly) equal size."""
    refs = []
    for part in range(parts):
        lo, hi = part * requests // parts, (part + 1) * requests // parts
        rows = []
        for i in range(lo, hi):
            messages = [Message(role="user", content=f"[makespan {i}] Which city lies NORTH of Paris, and why?")]
            sid = sample_id(DATASET, messages)
            rows.append(
                {
                    "sample_id": sid,
                    "dataset": DATASET,
                    "source_file": "bench.jsonl",
                    "source_row": i,
                    "messages": messages,
                    "prompt_id": sid,
                    "sample_index": 0,
                }
            )
        ref = PartRef(run_dir, "prompts", part)
        write_part(ref, pa.Table.from_pylist(rows, schema=PROMPTS), provenance={})
        refs.append(ref)
    return refs


def ideal_makespan(latencies: list[float], concurrency: int) -> float:
    """Finish time of the last request when each starts the moment one of `concurrency` slots frees up."""
    finishes: list[float] = []
    for latency in latencies:
        start = heapq.heappop(finishes) if len(finishes) >= concurrency else 0.0
        heapq.heappush(finishes, start + latency)
    return max(finishes, default=0.0)


def issued_latencies(run_dir: Path, parts: int, config: SimConfig) -> list[float]:
    """Per request in issue order, the latency the simulator slept for it; raises unless all done first time."""
    latencies = []
    for part in range(parts):
        order = read_part(PartRef(run_dir, "prompts", part), columns=["sample_id"]).column("sample_id").to_pylist()
        table = read_part(PartRef(run_dir, "responses", part), columns=["sample_id", "status", "generation_id"])
        rows = {r["sample_id"]: r for r in table.to_pylist()}
        for sid in order:
            row = rows.get(sid)
            if row is None or row["status"] != "done":
                raise RuntimeError(f"part {part}: sample {sid} has no done row ({row and row['status']})")
            match = GENERATION_ID.fullmatch(row["generation_id"] or "")
            if match is None:
                raise RuntimeError(f"part {part}: generation id {row['generation_id']!r} is not the simulator's")
            attempt, key = int(match.group(1)), match.group(2)
            if attempt != 1:
                raise RuntimeError(f"part {part}: sample {sid} needed attempt {attempt}; no failures were injected")
            latencies.append(request_latency_s(config, key, attempt))
    return latencies


def child(args: argparse.Namespace) -> None:
    """The stage itself, alone in this process; prints its JSON result."""
    cfg = pipeline_config(
        args.run_dir,
        args.base_url,
        args.model_dir,
        max_in_flight=args.concurrency,
        request_timeout_s=1800.0,
        connect_timeout_s=120.0,
    )
    refs = [PartRef(args.run_dir, "prompts", part) for part in range(args.parts)]
    profiler = cProfile.Profile() if args.profile_child else None
    with GcTimer() as gc_time:
        cpu, started = self_cpu_s(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        summary = generate_parts(cfg, refs, MARKERS)
        if profiler is not None:
            profiler.disable()
        wall, cpu = time.perf_counter() - started, self_cpu_s() - cpu
    if profiler is not None:
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(PROFILE_TOP)
            log(f"--- cProfile of generate_parts by {order} ---\n{text.getvalue()}")
    emit(
        {
            "wall_s": wall,
            "cpu_s": cpu,
            "gc_s": gc_time.seconds,
            "gc_collections": gc_time.collections,
            "peak_rss_mib": self_peak_rss_mib(),
            "total": summary.total(),
        }
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="prompts, one request each")
    parser.add_argument("--parts", type=int, default=40, help="prompts parts the requests are spread over")
    parser.add_argument("--concurrency", type=int, default=2000, help="endpoint.max_in_flight")
    parser.add_argument("--mu", type=float, default=1.4, help="log-normal latency: mean of log-seconds")
    parser.add_argument("--sigma", type=float, default=0.6, help="log-normal latency: sd of log-seconds")
    parser.add_argument("--reasoning-words", type=int, nargs=2, default=[2, 8], metavar=("MIN", "MAX"))
    parser.add_argument("--content-words", type=int, nargs=2, default=[1, 4], metavar=("MIN", "MAX"))
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,000 requests, 8 parts, C = 200, mu 0")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the stage (slows it; the ratio is then not meaningful)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.parts, args.concurrency, args.mu = 2000, 8, 200, 0.0
    if min(args.requests, args.parts, args.concurrency) < 1 or args.parts > args.requests:
        parser.error("--requests, --parts and --concurrency must be positive, with parts <= requests")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        if args.run_dir is None or args.base_url is None or args.model_dir is None:
            raise SystemExit("child mode needs --run-dir, --base-url and --model-dir")
        child(args)
        return 0
    raise_open_files(2 * args.concurrency + 1024)
    sim_config = {
        "latency_lognormal": [args.mu, args.sigma],
        "reasoning_words": args.reasoning_words,
        "content_words": args.content_words,
        "tool_call_rate": 0.0,
        "code_rate": 0.0,
    }
    load_at_start = os.getloadavg()[0]
    mean_latency = math.exp(args.mu + args.sigma**2 / 2)
    with tempfile.TemporaryDirectory(prefix="makespan-") as tmp:
        work = Path(tmp)
        model_dir = tokenizer_dir(work)
        run_dir = work / "run"
        write_prompts(run_dir, args.requests, args.parts)
        with SimProcess(model_dir, sim_config, work) as sim:
            log(
                f"simulator pid {sim.pid} at {sim.base_url}; {args.requests} requests in {args.parts} parts, "
                f"C={args.concurrency}, latency lognormal({args.mu}, {args.sigma}) mean {mean_latency:.2f} s; "
                f"{os.cpu_count()} CPUs"
            )
            sim_cpu = sim.cpu_s()
            cmd = ["--child", "--run-dir", str(run_dir), "--base-url", sim.base_url, "--model-dir", str(model_dir)]
            cmd += ["--concurrency", str(args.concurrency), "--parts", str(args.parts)]
            cmd += ["--profile-child"] if args.profile else []
            timeout = 600.0 + 20 * mean_latency * args.requests / args.concurrency
            stage = run_child(SCRIPT, cmd, timeout)
            sim_cpu = sim.cpu_s() - sim_cpu
            served = sim.stats()["total_requests"]
        latencies = issued_latencies(run_dir, args.parts, SimConfig.model_validate(sim_config))
    ideal = ideal_makespan(latencies, args.concurrency)
    total = stage["total"]
    measured = stage["wall_s"]
    result = {
        "bench": "makespan",
        "ratio": measured / ideal,
        "measured_s": measured,
        "measured_what": "wall time of generate_parts (load parts, all requests, chunk commits, part writes)",
        "ideal_s": ideal,
        "ideal_what": "C always in flight, engine issue order, each request exactly its simulator latency",
        "requests": len(latencies),
        "parts": args.parts,
        "concurrency": args.concurrency,
        "latency_lognormal": [args.mu, args.sigma],
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_max_s": max(latencies),
        "ideal_req_per_s": len(latencies) / ideal,
        "ideal_steady_req_per_s": args.concurrency / (sum(latencies) / len(latencies)),
        "measured_req_per_s": len(latencies) / measured,
        "served_requests": served,
        "stage_cpu_s": stage["cpu_s"],
        "stage_gc_s": stage["gc_s"],
        "stage_gc_collections": stage["gc_collections"],
        "stage_peak_rss_mib": stage["peak_rss_mib"],
        "sim_cpu_s": sim_cpu,
        "sim_cpu_util": sim_cpu / measured,
        "peak_in_flight": total.get("peak_in_flight"),
        "window_shrinks": total.get("window_shrinks"),
        "failed": total["failed"],
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": load_at_start,
    }
    log(
        f"generate_parts {measured:.2f} s vs ideal {ideal:.2f} s (ratio {measured / ideal:.3f}); "
        f"stage CPU {stage['cpu_s']:.1f} s, simulator CPU {sim_cpu:.1f} s, {served} requests served"
    )
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
