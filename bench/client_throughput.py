"""Request throughput of the project's `EndpointClient` against a bare aiohttp client, at thousands in flight.

What is measured: requests per second through the endpoint simulator at a fixed concurrency C (2,000 and 4,000
by default), for two clients sending the identical payloads (built by `tasks.generate.endpoints.build_request`
for an openai_chat config):

- raw: one `aiohttp.ClientSession(TCPConnector(limit=C))`, an `asyncio.Semaphore(C)`, post + read +
  `json.loads`, nothing else. This is what CPython + aiohttp can do on this machine, so it is the ceiling;
- project: `EndpointClient.generate(messages)` with `max_in_flight=C` (retry logic, classification, parsing
  into a `GenerationResult`), which is what the generate stage runs per sample, with the durability the stage
  adds: each attempt's "sent" record in the spend ledger before the request leaves, its settlement, and the
  answer's row in the journal, fsynced every 0.2 s by the writer threads (`--no-journal` leaves them out).
  The journal's own cost is reported as the writer threads' CPU seconds per 1,000 requests and bytes per answer.
  Each answer is turned into the row the engine builds (`_Run.record`, also with `--no-journal`), and, as in the
  engine, the row is what is kept, not the `SampleOutcome` (earlier versions kept every outcome until the
  end, so each full garbage collection rescanned thousands of result objects that a real run has dropped).

Why a ratio against raw aiohttp rather than against the ideal C / latency: on a small machine the simulator
and the client compete for the CPUs long before C / latency is reached, so the ideal says little about the
client. `ratio` = project req/s / raw req/s (the minimum over C): 1.0 means the client adds no throughput
cost over the bare HTTP stack. The ideal is reported too, so you can see how far both are from it.

How: the simulator runs in its own process with a fixed latency (so every request holds its slot for exactly
`--latency-s`), answering from its cache (a pool of `--pool` distinct prompts is cycled, and every prompt is
sent once before measuring). Each measurement is a fresh child process sending `--requests-per-c` x C
requests, so CPU time and peak RSS belong to that one client; both children import the same modules (the
project's, with transformers), so they start from the same heap. Raw and project alternate their order from
round to round (raw, project, project, raw, ...) so linear drift of a shared machine cancels in the means.

Reported per C, as the mean over rounds: req/s, CPU seconds per 1,000 requests (client process, user +
system), the share of that spent in the cyclic garbage collector (wall time inside collections), peak RSS
during the measurement (and at its start), the simulator's CPU seconds, and failures (any failure makes the
exit status non-zero). Both clients run under the garbage collector settings `generate_parts` uses for the
duration of a run (`tasks.generate.collector`: the import heap frozen, so full collections stop rescanning the
~230k objects that importing transformers leaves, and raised thresholds; `tasks.generate.heap_trim`: the C heap's
free pages given back every second); `--collector default` measures both with CPython's defaults and no trimming.
`--profile` adds one cProfile run of each client at the first C and prints the top functions by own time to
stderr (collector pauses are charged to whichever function happens to allocate, so read them next to the GC share).

    python bench/client_throughput.py                 # C = 2,000 and 4,000, 2 rounds (a few minutes)
    python bench/client_throughput.py --quick         # smoke run, seconds

Human-readable lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from _sim_process import (
    GcTimer,
    SimProcess,
    emit,
    engine_row,
    log,
    peak_rss_since_reset_mib,
    pipeline_config,
    raise_open_files,
    run_child,
    run_measured,
    self_cpu_s,
    self_peak_rss_mib,
    tokenizer_dir,
)

from endpoint_sim.responder import REASONING_CLOSE
from tasks.common.messages import Message
from tasks.generate.client import AttemptTag, EndpointClient
from tasks.generate.endpoints import CompletionMarkers, build_request
from tasks.generate.journal import AppendLog
from tasks.generate.ledger import LedgerWriter

SCRIPT = Path(__file__).resolve()
KINDS = ("raw", "project")
MARKERS = CompletionMarkers(reasoning_close=REASONING_CLOSE, end_of_turn="<｜end▁of▁sentence｜>")


def prompt_pool(size: int) -> list[list[Message]]:
    return [
        [Message(role="user", content=f"[throughput {i}] What lies NORTH of Paris, and how far is it in km?")]
        for i in range(size)
    ]


async def raw_client(url: str, payloads: list[dict[str, Any]], concurrency: int, requests: int) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)

    async def one(payload: dict[str, Any]) -> bool:
        async with limit, session.post(url, json=payload) as resp:
            raw = await resp.read()
            status = resp.status
        return status == 200 and "choices" in json.loads(raw)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        with GcTimer() as gc_time:
            started, cpu = time.perf_counter(), self_cpu_s()
            results = await asyncio.gather(
                *(one(payloads[i % len(payloads)]) for i in range(requests)), return_exceptions=True
            )
            wall, cpu = time.perf_counter() - started, self_cpu_s() - cpu
    errors = [r for r in results if r is not True]
    if errors:
        log(f"raw: {len(errors)} failed, first: {errors[0]!r}")
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "gc_s": gc_time.seconds,
        "gc_collections": gc_time.collections,
        "failures": len(errors),
        "retries": 0,
    }


async def project_client(
    base_url: str, model_dir: Path, pool: list[list[Message]], concurrency: int, requests: int, journaled: bool
) -> dict[str, Any]:
    cfg = pipeline_config(model_dir.parent, base_url, model_dir, max_in_flight=concurrency, request_timeout_s=600.0)
    with tempfile.TemporaryDirectory(prefix="journal-", dir=model_dir.parent) as tmp:
        ledger = LedgerWriter(Path(tmp), 0.2) if journaled else None
        journal = AppendLog(Path(tmp) / "journal.log", 0.2) if journaled else None

        errors: list[str] = []

        async def one(i: int) -> dict[str, Any]:
            sample_id = f"bench-{i}"
            outcome = await client.generate(pool[i % len(pool)], 0, AttemptTag(sample_id, "bench", 0))
            row = engine_row(sample_id, outcome)
            if journal is not None:
                journal.submit({"p": 0, "r": row})
            if row["status"] != "done":
                errors.append(f"{outcome.reason}: {outcome.error}")
            return row

        async with EndpointClient(cfg, MARKERS, None, ledger=ledger) as client:
            with GcTimer() as gc_time:
                started, cpu = time.perf_counter(), self_cpu_s()
                rows = await asyncio.gather(*(one(i) for i in range(requests)))
                wall, cpu = time.perf_counter() - started, self_cpu_s() - cpu
        logs = [log_ for log_ in (journal, ledger.log if ledger else None) if log_ is not None]
        for log_ in logs:
            log_.close()
    if errors:
        log(f"project: {len(errors)} failed, first: {errors[0]}")
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "gc_s": gc_time.seconds,
        "gc_collections": gc_time.collections,
        "failures": len(errors),
        "retries": sum(max(0, row["attempts"] - 1) for row in rows),
        "journal_writer_cpu_s": sum(log_.cpu_s for log_ in logs),
        "journal_bytes": sum(log_.bytes_written for log_ in logs),
    }


def child(args: argparse.Namespace) -> None:
    """One measurement of one client in this (fresh) process; prints its JSON result."""
    raise_open_files(args.concurrency + 1024)
    pool = prompt_pool(args.pool)
    if args.child == "raw":
        cfg = pipeline_config(args.model_dir.parent, args.base_url, args.model_dir, max_in_flight=args.concurrency)
        requests = [build_request(cfg, messages) for messages in pool]
        coro = raw_client(requests[0].url, [r.payload for r in requests], args.concurrency, args.requests)
    else:
        coro = project_client(args.base_url, args.model_dir, pool, args.concurrency, args.requests, args.journal)
    result, start_rss = run_measured(
        coro, args.collector, args.profile_child, f"{args.child} client, C={args.concurrency}, {args.requests} requests"
    )
    result.update(
        kind=args.child,
        requests=args.requests,
        concurrency=args.concurrency,
        req_per_s=args.requests / result["wall_s"],
        process_peak_rss_mib=self_peak_rss_mib(),
        start_rss_mib=start_rss,
        peak_rss_mib=peak_rss_since_reset_mib(),
    )
    emit(result)


def measure(
    sim: SimProcess,
    model_dir: Path,
    kind: str,
    concurrency: int,
    requests: int,
    args: argparse.Namespace,
    profile: bool = False,
) -> dict[str, Any]:
    cmd = [
        "--child",
        kind,
        "--base-url",
        sim.base_url,
        "--model-dir",
        str(model_dir),
        "--concurrency",
        str(concurrency),
        "--requests",
        str(requests),
        "--pool",
        str(args.pool),
    ]
    if profile:
        cmd.append("--profile-child")
    cmd += ["--collector", args.collector]
    if not args.journal:
        cmd.append("--no-journal")
    sim_cpu = sim.cpu_s()
    timeout = 120.0 + 20 * args.latency_s * requests / concurrency
    result = run_child(SCRIPT, cmd, timeout)
    result["sim_cpu_s"] = sim.cpu_s() - sim_cpu
    result["cpu_s_per_1k"] = 1000 * result["cpu_s"] / requests
    result["gc_share_of_cpu"] = result["gc_s"] / result["cpu_s"] if result["cpu_s"] else 0.0
    if "journal_bytes" in result:
        result["journal_cpu_s_per_1k"] = 1000 * result["journal_writer_cpu_s"] / requests
        result["journal_bytes_per_answer"] = result["journal_bytes"] / requests
    log(
        f"  C={concurrency:>5} {kind:<7}: {result['req_per_s']:8.1f} req/s  wall {result['wall_s']:6.2f} s  "
        f"client CPU {result['cpu_s_per_1k']:.3f} s/1k req "
        f"(GC {100 * result['gc_share_of_cpu']:.0f}%)  peak RSS {result['peak_rss_mib']:.0f} MiB "
        f"(from {result['start_rss_mib']:.0f})  sim CPU {result['sim_cpu_s']:.1f} s  failures {result['failures']}"
    )
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "req_per_s": statistics.fmean(r["req_per_s"] for r in runs),
        "cpu_s_per_1k": statistics.fmean(r["cpu_s_per_1k"] for r in runs),
        "gc_share_of_cpu": statistics.fmean(r["gc_share_of_cpu"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "start_rss_mib": max(r["start_rss_mib"] for r in runs),
        "process_peak_rss_mib": max(r["process_peak_rss_mib"] for r in runs),
        "sim_cpu_s": statistics.fmean(r["sim_cpu_s"] for r in runs),
        "failures": sum(r["failures"] for r in runs),
        "retries": sum(r["retries"] for r in runs),
        "rounds_req_per_s": [round(r["req_per_s"], 1) for r in runs],
        **(
            {
                "journal_cpu_s_per_1k": statistics.fmean(r["journal_cpu_s_per_1k"] for r in runs),
                "journal_bytes_per_answer": statistics.fmean(r["journal_bytes_per_answer"] for r in runs),
            }
            if "journal_bytes_per_answer" in runs[0]
            else {}
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2000, 4000], help="requests in flight")
    parser.add_argument("--latency-s", type=float, default=2.0, help="fixed simulator latency per request")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per client and C (order alternates)")
    parser.add_argument("--requests-per-c", type=float, default=3.0, help="requests per measurement, as x C")
    parser.add_argument("--pool", type=int, default=256, help="distinct prompts, cycled")
    parser.add_argument("--quick", action="store_true", help="smoke run: C = 200 and 400, 0.5 s latency, 1 round")
    parser.add_argument("--profile", action="store_true", help="add one cProfile run per client at the first C")
    parser.add_argument(
        "--collector",
        choices=("generate", "default"),
        default="generate",
        help="memory settings of both clients: generate's (frozen import heap, raised thresholds, heap trimming: "
        "tasks.generate.collector, tasks.generate.heap_trim) or CPython's defaults",
    )
    parser.add_argument(
        "--no-journal", dest="journal", action="store_false", help="project client without ledger and journal"
    )
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.latency_s, args.rounds = [200, 400], 0.5, 1
    if args.child is None and (min(args.concurrency) < 1 or args.rounds < 1 or args.requests_per_c <= 0):
        parser.error("--concurrency, --rounds and --requests-per-c must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        if args.base_url is None or args.model_dir is None or args.requests is None:
            raise SystemExit("child mode needs --base-url, --model-dir and --requests")
        args.concurrency = args.concurrency[0]
        child(args)
        return 0
    raise_open_files(2 * max(args.concurrency) + 1024)
    by_c: dict[str, Any] = {}
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="client-throughput-") as tmp:
        work = Path(tmp)
        model_dir = tokenizer_dir(work)
        with SimProcess(model_dir, {"latency_s": args.latency_s}, work) as sim:
            log(f"simulator pid {sim.pid} at {sim.base_url}, latency {args.latency_s} s; {os.cpu_count()} CPUs")
            measure(sim, model_dir, "raw", args.pool, args.pool, args)  # every prompt cached before measuring
            for concurrency in args.concurrency:
                requests = max(1, round(args.requests_per_c * concurrency))
                runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
                for round_no in range(args.rounds):
                    for kind in KINDS if round_no % 2 == 0 else KINDS[::-1]:
                        runs[kind].append(measure(sim, model_dir, kind, concurrency, requests, args))
                raw, project = summarize(runs["raw"]), summarize(runs["project"])
                ratio = project["req_per_s"] / raw["req_per_s"]
                by_c[str(concurrency)] = {
                    "requests": requests,
                    "ideal_req_per_s": concurrency / args.latency_s,
                    "raw": raw,
                    "project": project,
                    "ratio": ratio,
                }
                log(
                    f"C={concurrency}: project {project['req_per_s']:.1f} req/s vs raw {raw['req_per_s']:.1f} "
                    f"(ratio {ratio:.3f}); ideal {concurrency / args.latency_s:.0f} req/s"
                    + (
                        f"; journal writers {project['journal_cpu_s_per_1k']:.4f} CPU-s/1k req, "
                        f"{project['journal_bytes_per_answer']:.0f} B/answer"
                        if "journal_bytes_per_answer" in project
                        else ""
                    )
                )
            if args.profile:
                concurrency = args.concurrency[0]
                for kind in KINDS:
                    measure(sim, model_dir, kind, concurrency, round(args.requests_per_c * concurrency), args, True)
    failures = sum(c[k]["failures"] for c in by_c.values() for k in KINDS)
    emit(
        {
            "bench": "client_throughput",
            "ratio": min(c["ratio"] for c in by_c.values()),
            "by_c": by_c,
            "latency_s": args.latency_s,
            "rounds": args.rounds,
            "requests_per_c": args.requests_per_c,
            "pool": args.pool,
            "cpus": os.cpu_count(),
            "failures": failures,
            "loadavg_1m_at_start": load_at_start,
            "collector": args.collector,
            "journal": args.journal,
        }
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
