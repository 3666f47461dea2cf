"""The simulator's own bill: one record per billed completion, what a test compares a run directory's ledger with.

Why persisted: an outage test kills the endpoint process and starts a new one on the same port, and the bill
(and the generation records `GET /api/v1/generation` serves) must survive that, as a provider's does. Each
record is appended to the file with one unbuffered write, so a `kill -9` of the simulator keeps every record
it had billed. Each start of a simulator on the file is recorded too (`boot`): its attempt numbers, and so its
generation ids (`gen-<attempt>-<key>`), start at boot x 1,000,000, so a restarted simulator never hands out the
id of a request a killed one had in flight, and a client settling that id never finds another request's bill.

The key's account (`GET /api/v1/key`) is derived from it: `usage` is the sum of the records billed at least
`account_usage_lag_s` ago (OpenRouter's usage catches up with a lag), `limit_remaining` the key's limit minus it.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ATTEMPTS_PER_BOOT = 1_000_000


@dataclass(frozen=True, slots=True)
class Bill:
    id: str
    key: str
    cost_usd: float
    billed_at: float  # time.monotonic(): comparable across processes of one boot
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    provider: str
    model: str
    finish_reason: str
    streamed: bool
    cut: bool  # the client went away mid-generation: billed for the tokens generated until then


class BillingLedger:
    """Append-only, in billing order (`billed_at` never decreases within one process)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.bills: list[Bill] = []
        self._times: list[float] = []
        self._cumulative: list[float] = []
        self._fd: int | None = None
        self.boot = 0
        if path is not None:
            self._load(path)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, (json.dumps({"boot": self.boot}) + "\n").encode())

    @property
    def attempt_base(self) -> int:
        return self.boot * ATTEMPTS_PER_BOOT

    def _load(self, path: Path) -> None:
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                record = json.loads(line)
                if "boot" in record:
                    self.boot = max(self.boot, record["boot"] + 1)
                else:
                    self._append(Bill(**record))
            except (ValueError, TypeError):
                continue  # a line torn by a kill of the simulator

    def _append(self, bill: Bill) -> None:
        self.bills.append(bill)
        self._times.append(max(bill.billed_at, self._times[-1] if self._times else bill.billed_at))
        self._cumulative.append((self._cumulative[-1] if self._cumulative else 0.0) + bill.cost_usd)

    def add(self, bill: Bill) -> None:
        self._append(bill)
        if self._fd is not None:
            os.write(self._fd, (json.dumps(asdict(bill)) + "\n").encode())

    def usage_usd(self, now: float, lag_s: float = 0.0) -> float:
        """What the key's account shows at `now`: everything billed at least `lag_s` before it."""
        n = bisect.bisect_right(self._times, now - lag_s)
        return self._cumulative[n - 1] if n else 0.0

    def total_usd(self) -> float:
        return self._cumulative[-1] if self._cumulative else 0.0

    def to_dict(self) -> dict[str, Any]:
        records = [
            {"id": b.id, "key": b.key, "cost_usd": b.cost_usd, "billed_at": b.billed_at, "cut": b.cut}
            for b in self.bills
        ]
        return {"records": records, "total_usd": self.total_usd()}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
