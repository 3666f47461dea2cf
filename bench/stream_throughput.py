"""Server-Sent Events at production shape: thousands of long reasoning streams held open at a steady pace.

What is measured: N streams (2,000 and 10,000 by default) of long answers, all open at once, read by two clients
in turn from the same local server, each in a fresh child process:

- raw: one `aiohttp.ClientSession`, and per stream `post` + `resp.content.iter_any()`, splitting the bytes into
  lines and parsing each `data:` event's JSON with orjson (what the project's client uses), nothing else. This is
  what reading these streams costs in CPython + aiohttp on this machine when every event is parsed;
- project: `EndpointClient.generate(messages)` with `endpoint.stream: true` and `max_in_flight` = N, as the
  generate stage runs it: the spend ledger's records of every attempt and the answer's row in the journal
  (fsynced every 0.2 s by the writer threads; `--no-journal` leaves both out), the row built as the engine builds
  it.

The server (`endpoint_sim.long_streams`, its own process, one per N) holds every stream open: a `: OPENROUTER
PROCESSING` comment at once, then, after `--first-token-s`, reasoning deltas (with OpenRouter's
`reasoning_details` repeating the text), then content deltas, in chunks of 1-8 tokens, a comment every 32 chunks,
then the finish chunk, the usage chunk and `[DONE]`. Answer lengths are log-uniform in [`--tokens-min`,
`--tokens-max`] (2,000-30,000 tokens, mean 10,300; about 4.8 characters and 95 bytes of event per token); `--pool`
distinct answers, half of them ASCII-escaped with emoji cut between two chunks as UTF-16 halves. The pace: every
answer is spread evenly over `--stream-s` seconds (default: 60 s per 1,000 streams, so about 50,000 events a
second at every N), each stream stretched by its own factor in [1 - `--pace-spread`, 1] so they do not all end
together; all streams are open from the start, and hold most of their answer near the end (the worst case for
memory). `--tokens-per-s` runs every stream at that rate instead. Each stream's due chunks are written every
`--write-interval-s`, the streams spread evenly over that interval.

Reported per N, as means over rounds: data events per second, client CPU seconds per 1,000 events (user + system
of the client process over the measurement, so the journal and ledger writer threads are in it; theirs alone as
`journal_cpu_s_per_1k_events`), the share spent in the cyclic garbage collector, peak RSS of the client process
(the imports included: both clients import the project's modules, torch among them, so both start from the same
~400 MiB), and whether any stream fell behind: a stream's lag is when the client saw its end minus when the server
wrote it (`time.monotonic()`, one clock for all processes on Linux); a stream is behind when its lag exceeds
`--behind-s`. The server's own lateness (how late its pacing ticks ran) is reported too: when the server itself
cannot keep the pace, the run says so. `cpu_ratio` = project / raw CPU per 1,000 events (the maximum over N): 1.0
means the client costs what reading and parsing every event costs.

Fixed costs are not per event: the journal's and the ledger's writer threads wake every 20 ms whatever the load
(about 9 ms of CPU a second for the two), and each answer has its request, row and ledger records. At the quick
run's ~3,000 events a second they are a third of the project client's CPU, so `--quick` checks that everything
runs, not the ratio; at production rates (tens of thousands of events a second) they are a few percent.

The SGLang `/generate` path (`endpoint.kind: sglang_generate`) is not streamed by this client (the config refuses
`endpoint.stream` for it), so there is no second streaming path to measure.

Limits: every stream is one socket in the client and one in the server, so each process raises its soft
RLIMIT_NOFILE to what N needs (capped by the hard limit: 10,000 streams need a hard limit above ~11,000).

The project client runs under the memory settings the generate stage uses for a window: the collector's
(`tasks.generate.collector`: the import heap frozen, thresholds raised, which at 10,000 streams removes ~20 full
collections of 0.5-0.6 s each, pauses that put streams behind) and the C heap's (`tasks.generate.heap_trim`: free
pages inside the heap given back every second, which at 10,000 streams took peak RSS from 1,177 to 757 MiB); the
raw reader under CPython's defaults, as a plain aiohttp reader runs. `--raw-collector generate` gives the raw
reader the same settings (the stricter comparison of code alone), `--collector default` takes them from the
project client. The collections of each generation and the seconds spent in them, and the trims and their
seconds, are reported.

`--baseline REF` adds a third client: the project client of another commit (its `tasks/` extracted from git into a
scratch directory that comes first on the child's path), so a before/after comparison is measured side by side
(the client before incremental assembly, 75d4d34, cannot join UTF-16 halves: run it with `--no-split-surrogates`).

    python bench/stream_throughput.py                       # N = 2,000 and 10,000 (about 30 minutes)
    python bench/stream_throughput.py --streams 2000 --baseline 75d4d34 --no-split-surrogates
    python bench/stream_throughput.py --quick               # smoke run, about a minute

Human-readable lines go to stderr; the last stdout line is one JSON object. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

BASELINE_ENV = "STREAM_BENCH_BASELINE_TASKS"
if os.environ.get(BASELINE_ENV):  # a baseline child: that commit's `tasks/` before this checkout's
    sys.path[:0] = [os.environ[BASELINE_ENV], str(Path(__file__).resolve().parents[1])]

import aiohttp  # noqa: E402
import orjson  # noqa: E402
from _sim_process import (  # noqa: E402
    HOST,
    REPO,
    GcTimer,
    emit,
    engine_row,
    log,
    peak_rss_since_reset_mib,
    pipeline_config,
    process_cpu_s,
    raise_open_files,
    run_measured,
    self_cpu_s,
    self_peak_rss_mib,
    tokenizer_dir,
)

from endpoint_sim.long_answers import LongStreamConfig, long_answer, render_stream  # noqa: E402
from tasks.common.messages import Message  # noqa: E402
from tasks.generate.client import AttemptTag, EndpointClient  # noqa: E402
from tasks.generate.endpoints import CompletionMarkers, build_request  # noqa: E402
from tasks.generate.journal import AppendLog  # noqa: E402
from tasks.generate.ledger import LedgerWriter  # noqa: E402

SCRIPT = Path(__file__).resolve()
KINDS = ("raw", "project")
BASELINE_KIND = "baseline"
MARKERS = CompletionMarkers(reasoning_close="</think>", end_of_turn="")
START_TIMEOUT_S = 60.0


def prompts(n: int) -> list[list[Message]]:
    return [[Message(role="user", content=f"[stream {i}] Think it through at length, then answer.")] for i in range(n)]


class RawEvents:
    """The raw reader's per-stream state: the unfinished line and the generation id. Lines are split and parsed
    in `feed`, so no parsed event stays referenced while the stream waits for its next read (thousands of
    suspended readers each holding their last event would make the garbage collector rescan them all)."""

    __slots__ = ("events", "gen_id", "rest")

    def __init__(self) -> None:
        self.rest = b""
        self.gen_id: str | None = None
        self.events = 0

    def feed(self, data: bytes) -> bool:
        """True at `[DONE]`."""
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            if line[:6] == b"data: ":
                if line == b"data: [DONE]":
                    return True
                try:
                    chunk = orjson.loads(line[6:])
                except ValueError:  # what orjson refuses, such as half of a UTF-16 pair
                    chunk = json.loads(line[6:])
                self.events += 1
                if self.gen_id is None:
                    self.gen_id = chunk["id"]
        return False


async def raw_reader(url: str, payloads: list[bytes], concurrency: int) -> dict[str, Any]:
    ends: dict[str, float] = {}

    async def one(payload: bytes) -> bool:
        stream = RawEvents()
        async with limit, session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
            async for data in resp.content.iter_any():
                if stream.feed(data):
                    if stream.gen_id is not None:
                        ends[stream.gen_id] = time.monotonic()
                    return True
        return False

    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 64, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        with GcTimer() as gc_time:
            started, cpu = time.perf_counter(), self_cpu_s()
            results = await asyncio.gather(*(one(p) for p in payloads), return_exceptions=True)
            wall, cpu = time.perf_counter() - started, self_cpu_s() - cpu
    errors = [r for r in results if r is not True]
    if errors:
        log(f"raw: {len(errors)} failed, first: {errors[0]!r}")
    return {"wall_s": wall, "cpu_s": cpu, **gc_time.report(), "failures": len(errors), "ends": ends}


async def project_client(
    base_url: str, model_dir: Path, batch: list[list[Message]], timeout_s: float, journaled: bool
) -> dict[str, Any]:
    n = len(batch)
    cfg = pipeline_config(
        model_dir.parent, base_url, model_dir, max_in_flight=n, stream=True, request_timeout_s=timeout_s
    )
    ends: dict[str, float] = {}
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="journal-", dir=model_dir.parent) as tmp:
        ledger = LedgerWriter(Path(tmp), 0.2) if journaled else None
        journal = AppendLog(Path(tmp) / "journal.log", 0.2) if journaled else None

        async def one(i: int) -> None:
            sample_id = f"bench-{i}"
            outcome = await client.generate(batch[i], 0, AttemptTag(sample_id, "bench", 0))
            done_at = time.monotonic()
            row = engine_row(sample_id, outcome)
            if journal is not None:
                journal.submit({"p": 0, "r": row})
            if row["status"] != "done" or outcome.result is None or outcome.result.generation_id is None:
                errors.append(f"{outcome.reason}: {outcome.error}")
            else:
                ends[outcome.result.generation_id] = done_at

        async with EndpointClient(cfg, MARKERS, None, ledger=ledger) as client:
            with GcTimer() as gc_time:
                started, cpu = time.perf_counter(), self_cpu_s()
                await asyncio.gather(*(one(i) for i in range(n)))
                wall, cpu = time.perf_counter() - started, self_cpu_s() - cpu
        logs = [log_ for log_ in (journal, ledger.log if ledger else None) if log_ is not None]
        for log_ in logs:
            log_.close()
    if errors:
        log(f"project: {len(errors)} failed, first: {errors[0]}")
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        **gc_time.report(),
        "failures": len(errors),
        "ends": ends,
        "journal_writer_cpu_s": sum(log_.cpu_s for log_ in logs),
    }


def child(args: argparse.Namespace) -> None:
    """One measurement of one client in this (fresh) process; prints its JSON result."""
    import tasks

    raise_open_files(args.streams + 1024)
    batch = prompts(args.streams)
    timeout_s = 600.0 + 4 * args.expected_s
    if args.child == "raw":
        cfg = pipeline_config(args.model_dir.parent, args.base_url, args.model_dir, stream=True)
        requests = [build_request(cfg, messages) for messages in batch]
        payloads = [json.dumps(r.payload).encode() for r in requests]
        coro = raw_reader(requests[0].url, payloads, args.streams)
    else:
        coro = project_client(args.base_url, args.model_dir, batch, timeout_s, args.journal)
    result, start_rss = run_measured(
        coro, args.collector, args.profile_child, f"the {args.child} client, N={args.streams}"
    )
    result.update(
        kind=args.child,
        tasks_from=str(Path(tasks.__file__).resolve().parent),
        start_rss_mib=start_rss,
        peak_rss_mib=peak_rss_since_reset_mib(),
        process_peak_rss_mib=self_peak_rss_mib(),
    )
    print(json.dumps(result), flush=True)


class LongStreamProcess:
    """`python -m endpoint_sim.long_streams` on 127.0.0.1 in its own process (its own GIL and CPU count)."""

    def __init__(self, cfg: LongStreamConfig, work_dir: Path) -> None:
        self.cfg = cfg
        self.work_dir = work_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self.base_url = ""

    def __enter__(self) -> LongStreamProcess:
        config_path = self.work_dir / "long_streams.json"
        config_path.write_text(self.cfg.model_dump_json())
        port_file = self.work_dir / "long_streams_port"
        port_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "endpoint_sim.long_streams", "--host", HOST, "--port", "0"]
        argv += ["--port-file", str(port_file), "--config-json", str(config_path)]
        self._proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"long-stream server did not start (exit status {self._proc.poll()})")
            time.sleep(0.05)
        self.base_url = f"http://{HOST}:{int(port_file.read_text())}"
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)

    def call(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.base_url + path, data=b"" if method == "POST" else None, method=method)
        with urllib.request.urlopen(req, timeout=60) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out

    def cpu_s(self) -> float:
        assert self._proc is not None
        return process_cpu_s(self._proc.pid)


def baseline_tree(ref: str, into: Path) -> Path:
    """`tasks/` as it is at `ref`, extracted into `into`, which then shadows this checkout's on a child's path."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "tasks"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def measure(
    server: LongStreamProcess, kind: str, n: int, expected_s: float, args: argparse.Namespace, profile: bool = False
) -> dict[str, Any]:
    cmd = [sys.executable, str(SCRIPT), "--child", "raw" if kind == "raw" else "project"]
    cmd += ["--base-url", server.base_url, "--model-dir", str(args.model_dir), "--streams", str(n)]
    cmd += ["--expected-s", str(expected_s)]
    if profile:
        cmd.append("--profile-child")
    if not args.journal:
        cmd.append("--no-journal")
    cmd += ["--collector", args.raw_collector if kind == "raw" else args.collector]
    env = dict(os.environ)
    env.pop(BASELINE_ENV, None)
    if kind == BASELINE_KIND:
        env[BASELINE_ENV] = str(args.baseline_dir)
    server.call("POST", "/_reset")
    server_cpu = server.cpu_s()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, timeout=600 + 4 * expected_s, check=False)
    lines = proc.stdout.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} client at N={n} exited with {proc.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    stats = server.call("GET", "/_stats")
    result["kind"] = kind
    result["server_cpu_s"] = server.cpu_s() - server_cpu
    client_ends: dict[str, float] = result.pop("ends")
    lags = sorted(client_ends[gid] - at for gid, at in stats["ends"].items() if gid in client_ends)
    missing = stats["streams_finished"] - len(lags)
    events = stats["data_events"]
    result.update(
        streams=n,
        events=events,
        events_per_s=events / result["wall_s"],
        cpu_s_per_1k_events=1000 * result["cpu_s"] / events if events else float("nan"),
        gc_share_of_cpu=result["gc_s"] / result["cpu_s"] if result["cpu_s"] else 0.0,
        streams_finished=stats["streams_finished"],
        streams_unmatched=missing,
        max_lag_s=lags[-1] if lags else float("nan"),
        p99_lag_s=lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else float("nan"),
        streams_behind=sum(lag > args.behind_s for lag in lags),
        server_max_tick_late_s=stats["max_tick_late_s"],
        server_writes_while_paused=stats["writes_while_paused"],
    )
    if "journal_writer_cpu_s" in result and events:
        result["journal_cpu_s_per_1k_events"] = 1000 * result["journal_writer_cpu_s"] / events
    log(
        f"  N={n:>6} {kind:<8}: {result['events_per_s']:9.0f} events/s  wall {result['wall_s']:6.1f} s  "
        f"CPU {result['cpu_s_per_1k_events']:.4f} s/1k events (GC {100 * result['gc_share_of_cpu']:.0f}%, "
        f"collections {result['gc_collections']}, s {result['gc_s_by_generation']})  "
        f"peak RSS {result['peak_rss_mib']:.0f} MiB (from {result['start_rss_mib']:.0f}; heap trims "
        f"{result['heap_trims']}, {result['heap_trim_s']:.2f} s)  "
        f"lag max {result['max_lag_s']:.3f} s p99 {result['p99_lag_s']:.3f} s  behind {result['streams_behind']}  "
        f"server CPU {result['server_cpu_s']:.1f} s, late {result['server_max_tick_late_s']:.3f} s  "
        f"failures {result['failures']}"
    )
    if not result["tasks_from"].startswith(str(args.baseline_dir if kind == BASELINE_KIND else REPO)):
        raise RuntimeError(f"{kind} child imported tasks from {result['tasks_from']}")
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "events": runs[0]["events"],
        "events_per_s": statistics.fmean(r["events_per_s"] for r in runs),
        "cpu_s_per_1k_events": statistics.fmean(r["cpu_s_per_1k_events"] for r in runs),
        "gc_share_of_cpu": statistics.fmean(r["gc_share_of_cpu"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "start_rss_mib": max(r["start_rss_mib"] for r in runs),
        "heap_trim_s": statistics.fmean(r["heap_trim_s"] for r in runs),
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "max_lag_s": max(r["max_lag_s"] for r in runs),
        "p99_lag_s": max(r["p99_lag_s"] for r in runs),
        "streams_behind": sum(r["streams_behind"] for r in runs),
        "streams_unmatched": sum(r["streams_unmatched"] for r in runs),
        "failures": sum(r["failures"] for r in runs),
        "server_cpu_s": statistics.fmean(r["server_cpu_s"] for r in runs),
        "server_max_tick_late_s": max(r["server_max_tick_late_s"] for r in runs),
        "rounds_cpu_s_per_1k_events": [round(r["cpu_s_per_1k_events"], 5) for r in runs],
        **(
            {"journal_cpu_s_per_1k_events": statistics.fmean(r["journal_cpu_s_per_1k_events"] for r in runs)}
            if "journal_cpu_s_per_1k_events" in runs[0]
            else {}
        ),
    }


def stream_s(args: argparse.Namespace, n: int) -> float:
    """`--stream-s`, or 60 s per 1,000 streams: the same events per second at every N (about 50,000)."""
    return args.stream_s if args.stream_s is not None else max(30.0, n * args.stream_s_per_1k / 1000)


def server_config(args: argparse.Namespace, n: int) -> LongStreamConfig:
    return LongStreamConfig(
        seed=args.seed,
        pool=args.pool,
        tokens_min=args.tokens_min,
        tokens_max=args.tokens_max,
        tokens_per_s=args.tokens_per_s or 50.0,
        stream_s=None if args.tokens_per_s is not None else stream_s(args, n),
        first_token_s=args.first_token_s,
        pace_spread=args.pace_spread,
        write_interval_s=args.write_interval_s,
        split_surrogate_pairs=args.split_surrogates,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[2000, 10000], help="streams held open at once")
    parser.add_argument("--tokens-min", type=int, default=2000)
    parser.add_argument("--tokens-max", type=int, default=30000)
    parser.add_argument("--stream-s", type=float, help="every answer spread over this long (at every N)")
    parser.add_argument(
        "--stream-s-per-1k",
        type=float,
        default=60.0,
        help="without --stream-s: answers spread over this many seconds per 1,000 streams",
    )
    parser.add_argument("--tokens-per-s", type=float, help="instead of --stream-s: this rate for every stream")
    parser.add_argument(
        "--pace-spread", type=float, default=0.5, help="each stream's schedule stretched by a factor in [1-x, 1]"
    )
    parser.add_argument("--first-token-s", type=float, default=1.0, help="time to first token")
    parser.add_argument("--write-interval-s", type=float, default=0.25, help="how often a stream is written")
    parser.add_argument("--pool", type=int, default=64, help="distinct answers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="measurements per client and N (order alternates)")
    parser.add_argument("--behind-s", type=float, default=1.0, help="a stream this late at its end is behind")
    parser.add_argument("--baseline", metavar="REF", help="also measure the project client at this git ref")
    parser.add_argument(
        "--no-split-surrogates",
        dest="split_surrogates",
        action="store_false",
        help="never cut an emoji between two chunks (a client that cannot join UTF-16 halves fails otherwise)",
    )
    parser.add_argument("--profile", action="store_true", help="add one cProfile run per client at the first N")
    parser.add_argument(
        "--no-journal", dest="journal", action="store_false", help="project client without ledger and journal"
    )
    parser.add_argument(
        "--collector",
        choices=("generate", "default"),
        default="generate",
        help="the project client's memory settings: generate's (frozen import heap, raised thresholds, heap "
        "trimming: tasks.generate.collector, tasks.generate.heap_trim) or CPython's defaults",
    )
    parser.add_argument(
        "--raw-collector",
        choices=("generate", "default"),
        default="default",
        help="the raw reader's: CPython's defaults (a plain aiohttp reader), or generate's for a comparison "
        "under the same settings",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: N = 200, 20-second answers of 500-3,000")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--expected-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.tokens_min, args.tokens_max, args.stream_s = [200], 500, 3000, 20.0
    if args.child is None and (min(args.streams) < 1 or args.rounds < 1):
        parser.error("--streams and --rounds must be positive")
    return args


def measure_n(n: int, work: Path, args: argparse.Namespace, kinds: tuple[str, ...]) -> dict[str, Any]:
    cfg = server_config(args, n)
    answers = [render_stream(cfg, long_answer(cfg, i)) for i in range(cfg.pool)]
    expected_s = max(r.duration_s for r in answers)
    with LongStreamProcess(cfg, work) as server:
        spread = cfg.pace_spread
        stretch = -math.log(1 - spread) / spread if spread else 1.0  # the mean of 1 / pace, pace ~ U[1 - spread, 1]
        per_s = n * statistics.fmean(r.data_events / r.duration_s for r in answers) * stretch
        log(
            f"N={n}: {cfg.pool} answers of {cfg.tokens_min}-{cfg.tokens_max} tokens "
            f"(mean {statistics.fmean(r.data_events for r in answers):.0f} events), longest stream {expected_s:.0f} s, "
            f"about {per_s:.0f} events/s while all are open; load {os.getloadavg()[0]:.1f}"
        )
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        for round_no in range(args.rounds):
            for kind in kinds if round_no % 2 == 0 else kinds[::-1]:
                runs[kind].append(measure(server, kind, n, expected_s, args))
        if args.profile:
            for kind in KINDS:
                measure(server, kind, n, expected_s, args, profile=True)
    summary = {kind: summarize(runs[kind]) for kind in kinds}
    raw, project = summary["raw"], summary["project"]
    entry: dict[str, Any] = {
        **summary,
        "server": cfg.model_dump(),
        "cpu_ratio": project["cpu_s_per_1k_events"] / raw["cpu_s_per_1k_events"],
    }
    if BASELINE_KIND in summary:
        entry["baseline_cpu_ratio"] = summary[BASELINE_KIND]["cpu_s_per_1k_events"] / raw["cpu_s_per_1k_events"]
    log(
        f"N={n}: project {project['cpu_s_per_1k_events']:.4f} vs raw {raw['cpu_s_per_1k_events']:.4f} "
        f"CPU-s/1k events (ratio {entry['cpu_ratio']:.3f}"
        + (f", baseline {entry['baseline_cpu_ratio']:.3f}" if "baseline_cpu_ratio" in entry else "")
        + f"); project peak RSS {project['peak_rss_mib']:.0f} MiB; streams behind: project "
        f"{project['streams_behind']}, raw {raw['streams_behind']}"
    )
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        args.streams = args.streams[0]
        child(args)
        return 0
    raise_open_files(2 * max(args.streams) + 1024)
    kinds = (*KINDS, BASELINE_KIND) if args.baseline else KINDS
    load_at_start = os.getloadavg()[0]
    log(f"{os.cpu_count()} CPUs, load {load_at_start:.1f}")
    with tempfile.TemporaryDirectory(prefix="stream-throughput-") as tmp:
        work = Path(tmp)
        args.model_dir = tokenizer_dir(work)
        args.baseline_dir = baseline_tree(args.baseline, work / "baseline") if args.baseline else None
        by_n = {str(n): measure_n(n, work, args, kinds) for n in args.streams}
    failures = sum(e[kind]["failures"] + e[kind]["streams_unmatched"] for e in by_n.values() for kind in kinds)
    emit(
        {
            "bench": "stream_throughput",
            "cpu_ratio": max(e["cpu_ratio"] for e in by_n.values()),
            "project_peak_rss_mib": by_n[str(max(args.streams))]["project"]["peak_rss_mib"],
            "project_streams_behind": sum(e["project"]["streams_behind"] for e in by_n.values()),
            "raw_streams_behind": sum(e["raw"]["streams_behind"] for e in by_n.values()),
            "failures": failures,
            "by_n": by_n,
            "behind_s": args.behind_s,
            "rounds": args.rounds,
            "baseline": args.baseline,
            "journal": args.journal,
            "collector": {"project": args.collector, "raw": args.raw_collector},
            "cpus": os.cpu_count(),
            "loadavg_1m_at_start": load_at_start,
        }
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
