"""Plumbing shared by the generate-stage benchmarks: the endpoint simulator and each client in their own process.

Why separate processes: client and simulator are both asyncio + aiohttp in CPython; sharing one interpreter
would make them share one GIL, so the benchmark would measure their contention, not the client. A fresh child
process per client measurement also makes CPU time (`getrusage`) and peak RSS (`ru_maxrss`) belong to exactly
one client, with no pools, caches or heap growth carried over from the previous measurement.

Children report one JSON object as the last line of their stdout; their human-readable lines go to stderr.
Linux only (CPU time of the simulator is read from /proc). Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROFILE_TOP = 30
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig  # noqa: E402

# at import, before a client child freezes its heap: imported lazily on the first answer, the engine's modules
# were left for the collector to rescan and cost the project client ~15% of its requests per second
from tasks.generate.engine import RESULT_FIELDS  # noqa: E402

HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
MIB = 1024**2


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def raise_open_files(needed: int) -> int:
    """Soft RLIMIT_NOFILE up to `needed` (capped by the hard limit); children inherit it. Returns the new soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def self_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> float:
    """Reset this process's RSS high-water mark (VmHWM) so imports do not hide the measurement's own peak.

    Returns the current RSS in MiB, the baseline the measurement starts from.
    """
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") / 1024


def peak_rss_since_reset_mib() -> float:
    return _status_kib("VmHWM") / 1024


def collector_settings(kind: str) -> contextlib.AbstractContextManager[Any]:
    """`generate`: the generate window's memory settings, this checkout's even in a baseline child whose older
    `tasks/` predates them: the collector's (`tasks.generate.collector`) and the heap trimming thread's
    (`tasks.generate.heap_trim`). `default`: CPython's thresholds and no trimming, with only the import heap
    frozen: every client imports the project's modules (torch among them), which a plain reader would not carry,
    so no client pays for rescanning them."""
    if kind == "default":
        gc.collect()
        gc.freeze()
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(_checkout_module("collector").tuned_collector())
    stack.enter_context(_checkout_module("heap_trim").trimmed_heap())
    return stack


_LOADED: dict[str, Any] = {}


def _checkout_module(name: str) -> Any:
    """`tasks/generate/<name>.py` of this checkout, loaded from its file (once). A baseline child's older `tasks/`
    may lack `shared_setting`, which both settings modules import: this checkout's is put in its place."""
    if name in _LOADED:
        return _LOADED[name]
    if name != "shared_setting" and importlib.util.find_spec("tasks.generate.shared_setting") is None:
        sys.modules["tasks.generate.shared_setting"] = _checkout_module("shared_setting")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", REPO / "tasks" / "generate" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED[name] = module
    return module


class GcTimer:
    """Wall time spent in the cyclic garbage collector while active: with tens of thousands of live tasks,
    futures and buffers, full collections become a visible share of a client's CPU."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self.seconds_by_generation = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            spent = time.perf_counter() - self._started
            self.seconds += spent
            self.collections[info["generation"]] += 1
            self.seconds_by_generation[info["generation"]] += spent

    def report(self) -> dict[str, Any]:
        """`gc_s`, and the collections and seconds of each generation (which one costs is what to tune)."""
        return {
            "gc_s": self.seconds,
            "gc_collections": list(self.collections),
            "gc_s_by_generation": [round(s, 3) for s in self.seconds_by_generation],
        }

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        gc.callbacks.remove(self._callback)


class SimProcess:
    """`python -m endpoint_sim` as a child process on 127.0.0.1, bound to a free port it reports back.

    Its state lives in the other process, so it is read through the simulator's HTTP routes (`/_sim/stats`).
    """

    def __init__(self, model_dir: Path, config: dict[str, Any], work_dir: Path) -> None:
        self.model_dir = model_dir
        self.config = config
        self.work_dir = work_dir
        self.log_path = work_dir / "endpoint_sim.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("simulator is not running")
        return self._proc.pid

    @property
    def base_url(self) -> str:
        if self._port is None:
            raise RuntimeError("simulator is not running")
        return f"http://{HOST}:{self._port}"

    def start(self) -> SimProcess:
        config_path = self.work_dir / "sim_config.json"
        config_path.write_text(json.dumps(self.config))
        port_file = self.work_dir / "sim_port"
        port_file.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "endpoint_sim",
            "--model-dir",
            str(self.model_dir),
            "--host",
            HOST,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--config-json",
            str(config_path),
        ]
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            self._port = self._wait_for_port(self._proc, port_file)
            self.request("GET", "/health")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_port(self, proc: subprocess.Popen[bytes], port_file: Path) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = port_file.read_text().strip() if port_file.exists() else ""
            if text:
                return int(text)
            if proc.poll() is not None:
                raise RuntimeError(f"simulator exited with {proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulator wrote no port within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the simulator's output (its log lives in a scratch directory that is about to go)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        proc, self._proc, self._port = self._proc, None, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"simulator {method} {path}: HTTP {exc.code}: {exc.read()[:300]!r}") from exc

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.request("GET", "/_sim/stats?keys=0")
        return out

    def cpu_s(self) -> float:
        return process_cpu_s(self.pid)


def run_child(script: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `python script args...` in a fresh process; its last stdout line is its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        timeout=timeout_s,
        check=False,
    )
    lines = proc.stdout.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{script.name} {' '.join(args[:2])}: child exited with {proc.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def emit(result: dict[str, Any]) -> None:
    """The one machine-readable line a benchmark (or a child) prints on stdout."""
    print(json.dumps(result, sort_keys=True), flush=True)


def tokenizer_dir(root: Path) -> Path:
    from endpoint_sim.assets import write_tokenizer_dir

    return write_tokenizer_dir(root / "tokenizer")


def pipeline_config(run_dir: Path, base_url: str, model_dir: Path, **endpoint: Any) -> PipelineConfig:
    """An openai_chat `PipelineConfig` aimed at the simulator; `endpoint` overrides EndpointConfig fields. Not
    streaming unless `stream=True` is given (openai_chat's default streams): raw aiohttp reads one JSON body."""
    fields = {"kind": "openai_chat", "base_url": base_url, "model": "sim/deepseek-v4-sim", "stream": False}
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="bench", path=model_dir)],
        endpoint=EndpointConfig(**{**fields, **endpoint}),
        tokenizer=TokenizerConfig(path=model_dir),
    )


def engine_row(sample_id: str, outcome: Any) -> dict[str, Any]:
    """The row the engine builds from a `SampleOutcome` (`_Run.record`, outside the sample's coroutine) and
    journals: what it keeps of an answer once the outcome is dropped."""
    row: dict[str, Any] = {"sample_id": sample_id, "dataset": "bench", "attempts": outcome.attempts}
    if outcome.result is not None:
        row.update({name: getattr(outcome.result, name) for name in RESULT_FIELDS})
    failed = outcome.result is None or outcome.reason is not None
    row.update(status="failed" if failed else "done", failure_reason=outcome.reason)
    return row


def run_measured(coro: Any, collector: str, profile: bool, title: str) -> tuple[dict[str, Any], float]:
    """One client's measurement under `collector`'s settings (`collector_settings`): its result and the RSS at its
    start; with `profile`, the top functions by own time go to stderr."""
    import asyncio
    import cProfile
    import io
    import pstats

    with collector_settings(collector):
        start_rss = reset_peak_rss()
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        result: dict[str, Any] = asyncio.run(coro)
    trim = _LOADED.get("heap_trim")
    result.update(heap_trims=trim.TrimStats.calls if trim else 0, heap_trim_s=trim.TrimStats.seconds if trim else 0.0)
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(PROFILE_TOP)
        log(f"--- cProfile of {title} ---")
        log(text.getvalue())
    return result, start_rss
