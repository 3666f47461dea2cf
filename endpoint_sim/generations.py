"""What OpenRouter's GET /api/v1/generation?id=... tells about past completions: the billing a client reconciles.

Bounded (oldest dropped first) because a benchmark issues hundreds of thousands of completions; one record is a
slotted object of shared strings and numbers, not a dict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Generation:
    id: str
    cost_usd: float
    provider: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    finish_reason: str
    latency_ms: float
    generation_time_ms: float
    streamed: bool
    completed_at: float
    cancelled: bool = False

    def data(self, settled: bool = True, byok_fee_fraction: float | None = None) -> dict[str, Any]:
        """The record; with `byok_fee_fraction`, `cost_usd` (what the user paid) splits into OpenRouter's fee,
        `total_cost`, and the provider's price, `upstream_inference_cost`, as a BYOK record shows them."""
        if not settled:
            return {"id": self.id, "total_cost": 0, "provider_name": self.provider, "model": self.model}
        spent = self.cost_usd
        byok = {}
        if byok_fee_fraction is not None:
            upstream = spent / (1.0 + byok_fee_fraction)
            spent, byok = spent - upstream, {"is_byok": True, "upstream_inference_cost": upstream}
        return {
            "id": self.id,
            "total_cost": spent,
            **byok,
            "cancelled": self.cancelled,
            "provider_name": self.provider,
            "model": self.model,
            "streamed": self.streamed,
            "tokens_prompt": self.prompt_tokens,
            "tokens_completion": self.completion_tokens,
            "native_tokens_prompt": self.prompt_tokens,
            "native_tokens_completion": self.completion_tokens,
            "native_tokens_reasoning": self.reasoning_tokens,
            "finish_reason": self.finish_reason,
            "latency": round(self.latency_ms),
            "generation_time": round(self.generation_time_ms),
        }


class GenerationStore:
    """The last `size` generations by id; an id seen again (attempts restart after a stats reset) is replaced."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_id: dict[str, Generation] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, generation: Generation) -> None:
        self._by_id.pop(generation.id, None)
        self._by_id[generation.id] = generation
        while len(self._by_id) > self.size:
            del self._by_id[next(iter(self._by_id))]

    def visible(self, gen_id: str, delay_s: float, now: float | None = None) -> Generation | None:
        """The generation if it is known and at least `delay_s` old (OpenRouter indexes billing with a lag)."""
        found = self._by_id.get(gen_id)
        if found is None:
            return None
        now = time.monotonic() if now is None else now
        return found if now - found.completed_at >= delay_s else None
