"""The run directory's spend ledger: one append-only record set per request attempt, the only source of cost figures.

Invariant: every attempt that may have been billed is in the ledger before its request leaves the process (an
`s` record, written synchronously with the attempt's worst-case cost), and counts forever: failed attempts,
attempts whose row was later replaced, attempts of killed runs. Each attempt is in exactly one state
(docs/ledger-and-failures.md):

- `unsent`: the request never left (connection refused, DNS or TLS failure before it was written): $0;
- `answered`: an answer (or an error the provider does not bill) arrived with its cost;
- `pending`: sent, and no answer this process could read (timeout, reset after sending, stream cut, `kill -9`:
  an `s` with no `b`). It counts at its worst case until the provider's own records settle it;
- `settled`: was pending; its cost was read back from the provider (`/generation?id=`, or the key's account).

So `counted_usd` (billed + pending at worst case) is an upper bound of what the provider billed, equal to it once
nothing is pending; the budget of every run starts from it, so the cost cap holds over the directory's life.
A pending amount is never shown as spent: every surface shows `billed_usd` and `pending_usd` apart.

Layout: <run_dir>/spend/ledger-<token>.log, one segment per generate run (`tasks.generate.journal` framing).
Records (compact keys, JSON):
  {"k": "s", "a": uid, "id": sample_id, "d": dataset, "p": part, "w": worst_usd, "t": wall_time,
   "to": request_timeout_s}                                     sent
  {"k": "g", "a": uid, "g": generation_id}                      the id, as soon as it is known (first chunk)
  {"k": "b", "a": uid, "o": outcome, "c": cost_usd | null, "g": generation_id | null, "r": reason | null}  ended
  {"k": "r", "a": uid, "c": cost_usd, "src": SettledBy}         a pending attempt settled
  {"k": "acct", "at": "start" | "end", "usage": usd, "limit_remaining": usd | null, "t": wall_time,
   "host": name, "stable": bool}                                 the key's usage (GET /api/v1/key)
  {"k": "f", "id": sample_id, "r": reason, "fp": settings_fingerprint}   deterministic failure of a sample
Segments written before the states existed have `b` without `o`: a null cost there reads as pending.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tasks.generate.journal import AppendLog, read_records, segment_token

LEDGER_DIR = "spend"

AttemptState = Literal["unsent", "answered", "pending", "settled"]
Outcome = Literal["answered", "unsent", "pending"]
SettledBy = Literal["generation", "account", "configured_prices", "no_record"]
"""`no_record`: a request cut mid-generation (a kill, a reset), with a generation id, that an endpoint known to keep
records still has no record of once the generation would have ended (`settlement.generation_over`): never billed,
$0."""
NO_USAGE_COST = "no_usage_cost"
"""The pending reason of an answer that carried no usage.cost, until its generation record settles it."""


def ledger_dir(run_dir: Path) -> Path:
    return run_dir / LEDGER_DIR


@dataclass(slots=True)
class Attempt:
    sample_id: str
    dataset: str
    part: int
    worst_usd: float
    sent_at: float | None = None
    outcome: Outcome | None = None
    cost_usd: float | None = None
    generation_id: str | None = None
    reason: str | None = None
    settled_by: SettledBy | None = None
    estimate_usd: float | None = None
    """An answer that carried no usage.cost, pending its generation record: its configured prices' figure, what it
    is settled at when the endpoint turns out to keep no records."""
    timeout_s: float | None = None
    """`endpoint.request_timeout_s` when it was sent (absent in ledgers written before it was recorded): how long
    its generation could run, whatever a later run's config says."""

    @property
    def state(self) -> AttemptState:
        if self.settled_by is not None:
            return "settled"
        if self.outcome is None or self.outcome == "pending":
            return "pending"
        return self.outcome

    @property
    def billed_usd(self) -> float:
        """What the provider billed for it, as far as known: 0 while pending or when never sent."""
        return (self.cost_usd or 0.0) if self.state in ("answered", "settled") else 0.0

    @property
    def counted_usd(self) -> float:
        """What it counts against the cap: its billed cost, or its worst case while pending."""
        return self.worst_usd if self.state == "pending" else self.billed_usd


@dataclass
class SpendTotals:
    billed_usd: float = 0.0
    pending_usd: float = 0.0
    attempts: int = 0
    unsent_attempts: int = 0
    answered_attempts: int = 0
    pending_attempts: int = 0
    settled_attempts: int = 0
    settled_by: Counter[str] = field(default_factory=Counter)

    @property
    def counted_usd(self) -> float:
        """Billed plus pending at worst case: what the cost cap counts."""
        return self.billed_usd + self.pending_usd

    def add(self, attempt: Attempt) -> None:
        self.attempts += 1
        state = attempt.state
        if state == "pending":
            self.pending_attempts += 1
            self.pending_usd += attempt.worst_usd
            return
        self.billed_usd += attempt.billed_usd
        if state == "unsent":
            self.unsent_attempts += 1
        elif state == "answered":
            self.answered_attempts += 1
        else:
            self.settled_attempts += 1
            self.settled_by[attempt.settled_by or "generation"] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "billed_usd": round(self.billed_usd, 6),
            "pending_usd": round(self.pending_usd, 6),
            "counted_usd": round(self.counted_usd, 6),
            "attempts": self.attempts,
            "unsent_attempts": self.unsent_attempts,
            "answered_attempts": self.answered_attempts,
            "pending_attempts": self.pending_attempts,
            "settled_attempts": self.settled_attempts,
            "settled_by": dict(self.settled_by),
        }


@dataclass(frozen=True)
class AccountSnapshot:
    """The key's usage as the provider reported it. `stable`: read when nothing was in flight and the usage had
    stopped moving and covered every answer billed before it; only such snapshots bound a settlement window.
    `key`: which API key read it (`settlement.key_fingerprint`); None in segments written before it was kept."""

    at: str
    usage_usd: float
    limit_remaining_usd: float | None
    t: float
    host: str
    stable: bool
    key: str | None = None


@dataclass
class SpendLedger:
    """Everything the ledger segments of one run directory say, merged (read-only view)."""

    attempts: dict[str, Attempt] = field(default_factory=dict)
    deterministic: dict[str, tuple[str, str]] = field(default_factory=dict)  # sample_id -> (reason, fingerprint)
    accounts: list[AccountSnapshot] = field(default_factory=list)

    @classmethod
    def load(cls, run_dir: Path) -> SpendLedger:
        """Segments in name (= start time) order. A record about an attempt whose `s` is in a segment read later
        (hosts with skewed clocks) is applied once that `s` is known, so no settlement is lost to the order."""
        ledger = cls()
        deferred: list[dict[str, Any]] = []
        folder = ledger_dir(run_dir)
        for path in sorted(folder.glob("ledger-*.log")) if folder.is_dir() else []:
            for rec in read_records(path):
                if not ledger.apply(rec):
                    deferred.append(rec)
        for rec in deferred:
            ledger.apply(rec)
        return ledger

    def apply(self, rec: dict[str, Any]) -> bool:
        """Fold one record in; False when it names an attempt not seen yet (the caller may apply it later)."""
        kind = rec.get("k")
        if kind == "s":
            if rec["a"] in self.attempts:  # a spilled segment repeats what reached the failed disk as well
                return True
            self.attempts[rec["a"]] = Attempt(
                rec["id"], rec["d"], rec["p"], rec["w"], rec.get("t"), timeout_s=rec.get("to")
            )
            return True
        if kind == "f":
            self.deterministic[rec["id"]] = (rec["r"], rec["fp"])
            return True
        if kind == "acct":
            self.accounts.append(
                AccountSnapshot(
                    rec["at"],
                    rec["usage"],
                    rec.get("limit_remaining"),
                    rec["t"],
                    rec.get("host", ""),
                    rec["stable"],
                    rec.get("key"),
                )
            )
            return True
        attempt = self.attempts.get(rec.get("a", ""))
        if attempt is None:
            return kind not in ("g", "b", "r")
        if kind == "g":
            attempt.generation_id = attempt.generation_id or rec.get("g")
        elif kind == "b":
            cost = rec.get("c")
            outcome: Outcome = rec.get("o") or ("answered" if cost is not None else "pending")
            attempt.outcome = outcome
            attempt.cost_usd = None if outcome == "pending" else (cost or 0.0)
            attempt.generation_id = rec.get("g") or attempt.generation_id
            attempt.reason = rec.get("r")
            attempt.estimate_usd = rec.get("e")
        elif kind == "r" and attempt.settled_by is None:
            attempt.settled_by = rec.get("src", "generation")
            attempt.cost_usd = rec["c"]
        return True

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

    def totals_of_run(self, token: str) -> SpendTotals:
        out = SpendTotals()
        prefix = f"{token}:"
        for uid, attempt in self.attempts.items():
            if uid.startswith(prefix):
                out.add(attempt)
        return out

    def pending_with_ids(self) -> list[tuple[str, str, float]]:
        """(uid, generation id, worst case) of pending attempts the provider's generation record can settle."""
        return [
            (uid, a.generation_id, a.worst_usd)
            for uid, a in self.attempts.items()
            if a.generation_id and a.worst_usd > 0 and a.state == "pending"
        ]

    def stable_accounts(self) -> list[AccountSnapshot]:
        return sorted((s for s in self.accounts if s.stable), key=lambda s: s.t)


class LedgerWriter:
    """This run's segment. `sent` is synchronous (before the request leaves); the rest is group-committed.
    Each method returns the record it wrote, so a caller can fold it into its in-memory `SpendLedger`."""

    def __init__(
        self,
        run_dir: Path,
        group_commit_s: float,
        on_write_error: Callable[[OSError], bool] | None = None,
        keep_until_acknowledged: bool = False,
    ) -> None:
        self.token = segment_token()
        path = ledger_dir(run_dir) / f"ledger-{self.token}.log"
        self.log = AppendLog(path, group_commit_s, on_write_error, keep_until_acknowledged)
        self._ids = itertools.count()

    def sent(self, sample_id: str, dataset: str, part: int, worst_usd: float, timeout_s: float | None = None) -> str:
        uid = f"{self.token}:{next(self._ids)}"
        rec = {"k": "s", "a": uid, "id": sample_id, "d": dataset, "p": part, "w": worst_usd, "t": time.time()}
        if timeout_s is not None:
            rec["to"] = timeout_s
        self.log.write_now(rec)
        return uid

    def generation(self, uid: str, generation_id: str) -> None:
        self.log.submit({"k": "g", "a": uid, "g": generation_id})

    def ended(
        self,
        uid: str,
        outcome: Outcome,
        cost_usd: float | None,
        generation_id: str | None,
        reason: str | None,
        estimate_usd: float | None = None,
    ) -> None:
        """The attempt's outcome: `answered` with its cost (0.0 for an error nobody bills), `unsent` ($0), or
        `pending` (cost null: counted at its worst case until settled; `estimate_usd` its priced figure)."""
        cost = None if outcome == "pending" else (0.0 if outcome == "unsent" else cost_usd)
        rec = {"k": "b", "a": uid, "o": outcome, "c": cost, "g": generation_id, "r": reason}
        if estimate_usd is not None:
            rec["e"] = estimate_usd
        self.log.submit(rec)

    def settled(self, uid: str, cost_usd: float, src: SettledBy) -> dict[str, Any]:
        rec = {"k": "r", "a": uid, "c": cost_usd, "src": src}
        self.log.submit(rec)
        return rec

    def account(
        self,
        at: Literal["start", "end"],
        usage_usd: float,
        limit_remaining_usd: float | None,
        stable: bool,
        key: str | None = None,
    ) -> dict[str, Any]:
        rec = {
            "k": "acct",
            "at": at,
            "usage": usage_usd,
            "limit_remaining": limit_remaining_usd,
            "t": time.time(),
            "host": socket.gethostname(),
            "stable": stable,
            "key": key,
        }
        self.log.submit(rec)
        return rec

    def deterministic_failure(self, sample_id: str, reason: str, fingerprint: str) -> None:
        self.log.submit({"k": "f", "id": sample_id, "r": reason, "fp": fingerprint})

    def flush(self) -> None:
        """Every record submitted so far is in the segment (and fsynced): for a reader of the run directory."""
        self.log.flush()

    def close(self) -> None:
        self.log.close()
