"""The run directory's spend ledger: one append-only record per request attempt, the only source of cost figures.

Invariant: every attempt that may have been billed is in the ledger before its request leaves the process
(a "sent" record, written synchronously with the attempt's worst-case cost), and counts forever: failed
attempts, attempts whose row was later replaced, attempts of killed runs. An attempt whose outcome was never
recorded ("sent" without "settled", e.g. in flight at a `kill -9`) counts at its worst case until it is
reconciled, so `total_usd` is an upper bound of what the provider billed, and equal to it when nothing is
unknown. The budget of every run starts from `total_usd`, so the cost cap holds over the directory's life.

Layout: <run_dir>/spend/ledger-<token>.log, one segment per generate run (`tasks.generate.journal` framing).
Records (compact keys, JSON):
  {"k": "s", "a": uid, "id": sample_id, "d": dataset, "p": part, "w": worst_usd}    sent
  {"k": "b", "a": uid, "c": cost_usd | null, "g": generation_id | null, "r": reason | null}   settled
  {"k": "r", "a": uid, "c": cost_usd}     reconciled (OpenRouter /generation for an unknown with an id)
  {"k": "f", "id": sample_id, "r": reason, "fp": settings_fingerprint}   deterministic failure of a sample
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.generate.journal import AppendLog, read_records, segment_token

LEDGER_DIR = "spend"


def ledger_dir(run_dir: Path) -> Path:
    return run_dir / LEDGER_DIR


@dataclass
class Attempt:
    sample_id: str
    dataset: str
    part: int
    worst_usd: float
    settled: bool = False
    cost_usd: float | None = None
    generation_id: str | None = None
    reason: str | None = None

    @property
    def known(self) -> bool:
        return self.settled and self.cost_usd is not None

    @property
    def counted_usd(self) -> float:
        """What this attempt counts for: its billed cost when known, else its worst case."""
        return self.cost_usd if self.known and self.cost_usd is not None else self.worst_usd


@dataclass
class SpendTotals:
    billed_usd: float = 0.0
    unknown_usd: float = 0.0
    attempts: int = 0
    unknown_attempts: int = 0

    @property
    def total_usd(self) -> float:
        return self.billed_usd + self.unknown_usd

    def add(self, attempt: Attempt) -> None:
        self.attempts += 1
        if attempt.known:
            self.billed_usd += attempt.cost_usd or 0.0
        else:
            self.unknown_attempts += 1
            self.unknown_usd += attempt.worst_usd

    def to_dict(self) -> dict[str, Any]:
        return {
            "spent_usd": round(self.total_usd, 6),
            "billed_usd": round(self.billed_usd, 6),
            "unknown_worst_case_usd": round(self.unknown_usd, 6),
            "attempts": self.attempts,
            "unknown_attempts": self.unknown_attempts,
        }


@dataclass
class SpendLedger:
    """Everything the ledger segments of one run directory say, merged (read-only view)."""

    attempts: dict[str, Attempt] = field(default_factory=dict)
    deterministic: dict[str, tuple[str, str]] = field(default_factory=dict)  # sample_id -> (reason, fingerprint)

    @classmethod
    def load(cls, run_dir: Path) -> SpendLedger:
        ledger = cls()
        folder = ledger_dir(run_dir)
        for path in sorted(folder.glob("ledger-*.log")) if folder.is_dir() else []:
            for rec in read_records(path):
                ledger.apply(rec)
        return ledger

    def apply(self, rec: dict[str, Any]) -> None:
        kind = rec.get("k")
        if kind == "s":
            self.attempts[rec["a"]] = Attempt(rec["id"], rec["d"], rec["p"], rec["w"])
        elif kind in ("b", "r"):
            attempt = self.attempts.get(rec["a"])
            if attempt is None:
                return
            attempt.settled = True
            if kind == "r" or rec.get("c") is not None or attempt.cost_usd is None:
                attempt.cost_usd = rec.get("c")
            if kind == "b":
                attempt.generation_id = rec.get("g")
                attempt.reason = rec.get("r")
        elif kind == "f":
            self.deterministic[rec["id"]] = (rec["r"], rec["fp"])

    def totals(self) -> SpendTotals:
        out = SpendTotals()
        for attempt in self.attempts.values():
            out.add(attempt)
        return out

    def totals_by_dataset(self, parts: set[int] | None = None) -> dict[str, SpendTotals]:
        out: dict[str, SpendTotals] = {}
        for attempt in self.attempts.values():
            if parts is None or attempt.part in parts:
                out.setdefault(attempt.dataset, SpendTotals()).add(attempt)
        return out

    def totals_by_part(self, token: str | None = None) -> dict[int, SpendTotals]:
        """Per part; with `token`, only the attempts of the run that wrote that ledger segment."""
        out: dict[int, SpendTotals] = {}
        for uid, attempt in self.attempts.items():
            if token is None or uid.startswith(f"{token}:"):
                out.setdefault(attempt.part, SpendTotals()).add(attempt)
        return out

    def reconcilable(self) -> list[tuple[str, str]]:
        """(uid, generation_id) of attempts billed an unknown amount whose generation id is known."""
        return [
            (uid, a.generation_id)
            for uid, a in self.attempts.items()
            if a.settled and a.cost_usd is None and a.generation_id
        ]


class LedgerWriter:
    """This run's segment. `sent` is synchronous (before the request leaves); the rest is group-committed."""

    def __init__(self, run_dir: Path, group_commit_s: float) -> None:
        self.token = segment_token()
        self.log = AppendLog(ledger_dir(run_dir) / f"ledger-{self.token}.log", group_commit_s)
        self._ids = itertools.count()

    def sent(self, sample_id: str, dataset: str, part: int, worst_usd: float) -> str:
        uid = f"{self.token}:{next(self._ids)}"
        self.log.write_now({"k": "s", "a": uid, "id": sample_id, "d": dataset, "p": part, "w": worst_usd})
        return uid

    def settled(self, uid: str, cost_usd: float | None, generation_id: str | None, reason: str | None) -> None:
        self.log.submit({"k": "b", "a": uid, "c": cost_usd, "g": generation_id, "r": reason})

    def reconciled(self, uid: str, cost_usd: float) -> None:
        self.log.submit({"k": "r", "a": uid, "c": cost_usd})

    def deterministic_failure(self, sample_id: str, reason: str, fingerprint: str) -> None:
        self.log.submit({"k": "f", "id": sample_id, "r": reason, "fp": fingerprint})

    def close(self) -> None:
        self.log.close()
