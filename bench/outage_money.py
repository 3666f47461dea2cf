"""What an endpoint outage and `kill -9`s of `generate` cost, measured against the provider's own bill, for any
checkout of the project (issue 19's before/after figures).

The provider is this checkout's simulator with a billing file (`endpoint_sim.billing`), so its bill survives the
endpoint being killed; `generate` comes from `--repo` (this checkout by default; pass another checkout, e.g.
the main branch, to measure it the same way). "Recorded" is the run directory's spend ledger read by this
checkout: billed plus pending at worst case, which is what the cost cap counts (a checkout from before the
ledger states wrote no outcome for a refused request, so those read as pending, as that checkout counted them).

- `outage`: the shipped configs/run.yaml (SGLang /generate, 64 in flight, $5 cap, the demo data) against
  `python -m endpoint_sim`, which is killed with SIGKILL once `--kill-in-flight` requests are in flight and
  restarted on the same port `--down-s` later. Requests sent while it was down = the attempts in the run
  directory's ledger minus the requests the two simulator processes received.
- `kills`: `--prompts` prompts at `--in-flight` (2,000), killed `--kills` times while the window is at least 3/4
  full, then one run under the same cap (blocked if it sends nothing while work is left), then a run with the
  cap raised to completion (with `--settle`, and the checkout supporting it, key settlement on).

    python bench/outage_money.py outage [--down-s 60] [--repo /path/to/main] [--set endpoint.max_cost_usd=1000]
    python bench/outage_money.py kills [--stream true|false] [--settle] [--repo /path/to/main]

The last stdout line is one JSON object with the figures. The machine's load changes wall times, not these counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _sim_process import raise_open_files  # noqa: E402

from endpoint_sim.assets import ensure_tiny_model_dir, write_tokenizer_dir  # noqa: E402
from endpoint_sim.responder import SimConfig  # noqa: E402
from endpoint_sim.server import SimulatorServer  # noqa: E402
from tasks.common.shards import done_parts, read_part  # noqa: E402
from tasks.generate.ledger import SpendLedger  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def billed_usd(bill: Path) -> float:
    total = 0.0
    for line in bill.read_text().splitlines():
        record = json.loads(line)
        total += record.get("cost_usd", 0.0)
    return total


def generate(repo: Path, config: Path, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(repo.resolve())}
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "generate", str(config), "--no-progress", *extra],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def last_json(log_path: Path) -> dict[str, Any]:
    for line in reversed(log_path.read_text().splitlines()):
        if line.startswith("{"):
            out: dict[str, Any] = json.loads(line)
            return out
    return {}


def responses(run_dir: Path) -> list[dict[str, Any]]:
    return [row for ref in done_parts(run_dir, "responses") for row in read_part(ref).to_pylist()]


def ledger_figures(run_dir: Path) -> dict[str, Any]:
    totals = SpendLedger.load(run_dir).totals()
    return {
        "recorded_usd": round(totals.counted_usd, 6),
        "ledger_billed_usd": round(totals.billed_usd, 6),
        "pending_usd": round(totals.pending_usd, 6),
        "attempts": totals.attempts,
    }


# --- the endpoint killed mid-run ---------------------------------------------------------------------------------
class SimProcess:
    def __init__(self, model_dir: Path, port: int, config: Path, bill: Path, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "endpoint_sim", "--model-dir", str(model_dir), "--port", str(port)]
        cmd += ["--config-json", str(config), "--billing-file", str(bill)]
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                get_json(f"{self.url}/_sim/stats?keys=0")
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "the simulator did not start"
                time.sleep(0.05)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = get_json(f"{self.url}/_sim/stats?keys=0")
        return out

    def kill_9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def outage(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = ensure_tiny_model_dir(work / "tiny")
    base = yaml.safe_load((REPO / "configs" / "run.yaml").read_text())
    port = free_port()
    ep = base["endpoint"]
    sim_cfg = SimConfig(
        seed=5,
        model_name=ep["model"],
        latency_lognormal=(math.log(args.latency_s), 0.3),
        price_prompt_usd_per_mtok=ep["price_prompt_usd_per_mtok"],
        price_completion_usd_per_mtok=ep["price_completion_usd_per_mtok"],
    )
    sim_json = work / "sim.json"
    sim_json.write_text(sim_cfg.model_dump_json())
    base["run_dir"] = str(work / "run")
    for dataset in base["datasets"]:
        dataset["path"] = str((REPO / "configs" / dataset["path"]).resolve())
    base["tokenizer"]["path"] = str(model_dir)
    ep["base_url"] = f"http://127.0.0.1:{port}"
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump(base))
    bill, sim_log, gen_log = work / "bill.jsonl", work / "sim.log", work / "generate.log"
    sim = SimProcess(model_dir, port, sim_json, bill, sim_log)
    started = time.monotonic()
    proc = generate(args.repo, config, gen_log, *(x for s in args.set for x in ("--set", s)))
    while sim.stats()["in_flight"] < args.kill_in_flight:
        assert proc.poll() is None, gen_log.read_text()[-3000:]
        time.sleep(0.01)
    before = sim.stats()
    sim.kill_9()
    down_at = time.monotonic()
    log(f"endpoint killed with {before['in_flight']} in flight; down for {args.down_s:g} s")
    time.sleep(args.down_s)
    sim = SimProcess(model_dir, port, sim_json, bill, sim_log)
    up_at = time.monotonic()
    code = proc.wait(timeout=3600)
    after = sim.stats()
    sim.stop()
    rows = responses(work / "run")
    summary = last_json(gen_log)
    figures = ledger_figures(work / "run")
    received = before["total_requests"] + after["total_requests"]
    return {
        "exit_code": code,
        "in_flight_at_kill": before["in_flight"],
        "down_s": round(up_at - down_at, 1),
        "requests_sent_while_down": figures["attempts"] - received,
        **figures,
        "billed_usd": round(billed_usd(bill), 6),
        "samples_done": sum(r["status"] == "done" for r in rows),
        "samples_failed": sum(r["status"] == "failed" for r in rows),
        "failed_reasons": sorted({r["failure_reason"] for r in rows if r["status"] == "failed"}),
        "stopped": summary.get("stopped"),
        "wall_s": round(time.monotonic() - started, 1),
    }


# --- kill -9s of generate at 2,000 in flight ---------------------------------------------------------------------
def kills(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = write_tokenizer_dir(work / "tokenizer")
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"[kills] question {i}: why?"}]}) + "\n"
            for i in range(args.prompts)
        )
    )
    sim_cfg = SimConfig(
        seed=3, latency_lognormal=(math.log(args.latency_s), 0.3), reasoning_words=(5, 30), content_words=(5, 30)
    )
    bill = work / "bill.jsonl"
    gen_log = work / "generate.log"
    out: dict[str, Any] = {"stream": args.stream, "in_flight": args.in_flight, "prompts": args.prompts}
    with SimulatorServer(model_dir, sim_cfg, billing_file=bill) as sim:

        def config(cap: float, settle: bool) -> Path:
            endpoint: dict[str, Any] = {
                "base_url": sim.base_url,
                "model": "sim/deepseek-v4-sim",
                "max_in_flight": args.in_flight,
                "price_prompt_usd_per_mtok": sim_cfg.price_prompt_usd_per_mtok,
                "price_completion_usd_per_mtok": sim_cfg.price_completion_usd_per_mtok,
                "max_cost_usd": cap,
                "stream": args.stream == "true",
            }
            if settle:
                endpoint.update(account_settlement="exclusive_key", account_settle_stable_s=1.0)
            path = work / f"config-{cap:g}-{settle}.yaml"
            path.write_text(
                yaml.safe_dump(
                    {
                        "run_dir": str(work / "run"),
                        "samples_per_shard": 500,
                        "datasets": [{"name": "kills", "path": str(data)}],
                        "endpoint": endpoint,
                        "sampling": {"max_tokens": args.max_tokens},
                        "tokenizer": {"path": str(model_dir)},
                    }
                )
            )
            return path

        capped = config(args.cap, args.settle)
        for n in range(args.kills):
            before = len(sim.billing()["records"])
            proc = generate(args.repo, capped, gen_log)
            deadline = time.monotonic() + 600
            while not (
                sim.stats(with_keys=False)["in_flight"] >= args.in_flight * 3 // 4
                and len(sim.billing()["records"]) >= before + args.in_flight // 10
            ):
                if proc.poll() is not None:
                    log(f"kill {n + 1}: generate ended before the window filled (exit {proc.returncode})")
                    break
                assert time.monotonic() < deadline, gen_log.read_text()[-3000:]
                time.sleep(0.01)
            in_flight = sim.stats(with_keys=False)["in_flight"]
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            time.sleep(1.0)
            figures = ledger_figures(work / "run")
            log(f"kill {n + 1} at {in_flight} in flight: {figures}, billed {sim.billing()['total_usd']:.6f}")
        out["after_kills"] = {**ledger_figures(work / "run"), "billed_usd": round(sim.billing()["total_usd"], 6)}
        sent_before = sim.stats(with_keys=False)["total_requests"]
        gen_log = work / "generate-next.log"
        proc = generate(args.repo, capped, gen_log)
        code = proc.wait(timeout=3600)
        left = args.prompts - sum(r["status"] == "done" for r in responses(work / "run"))
        sent = sim.stats(with_keys=False)["total_requests"] - sent_before
        out["next_run_same_cap"] = {
            "exit_code": code,
            "requests_sent": sent,
            "blocked": sent == 0 and left > 0,
            "settlement": last_json(gen_log).get("settlement"),
        }
        gen_log = work / "generate-final.log"
        proc = generate(args.repo, config(args.cap * 100, args.settle), gen_log)
        out["final_exit_code"] = proc.wait(timeout=3600)
        rows = responses(work / "run")
        notices = [line for line in gen_log.read_text().splitlines() if line.startswith("pending:")]
        out["final"] = {
            **ledger_figures(work / "run"),
            "billed_usd": round(sim.billing()["total_usd"], 6),
            "samples_done": sum(r["status"] == "done" for r in rows),
            "samples_unique": len({r["sample_id"] for r in rows}),
            "pending_notice": notices[-1] if notices else None,
            "max_billed_usd_while_capped": out["after_kills"]["billed_usd"],
        }
        final = out["final"]
        final["recorded_over_billed"] = round(final["recorded_usd"] / final["billed_usd"], 4)
    return out


def main() -> int:
    raise_open_files(65536)  # the in-process simulator holds 2,000 sockets, and so does generate
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=("outage", "kills"))
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose `generate` runs")
    parser.add_argument("--set", action="append", default=[], help="outage: extra `generate --set` overrides")
    parser.add_argument("--down-s", type=float, default=60.0)
    parser.add_argument("--kill-in-flight", type=int, default=60, help="outage: kill the endpoint at this many")
    parser.add_argument("--latency-s", type=float, default=2.0, help="median simulator latency (lognormal)")
    parser.add_argument("--prompts", type=int, default=6000)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--cap", type=float, default=3.0, help="kills: endpoint.max_cost_usd")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stream", choices=("true", "false"), default="true")
    parser.add_argument("--settle", action="store_true", help="kills: account_settlement exclusive_key")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix=f"outage-money-{args.scenario}-") as tmp:
        figures = outage(args, Path(tmp)) if args.scenario == "outage" else kills(args, Path(tmp))
    print(json.dumps({"bench": f"outage_money.{args.scenario}", "repo": str(args.repo), **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
