"""The two admission gates of the client in isolation: the cost budget and the adaptive in-flight window."""

from __future__ import annotations

import asyncio

import pytest

from tasks.generate.client import AdaptiveWindow, Budget, BudgetExhausted


def test_budget_waits_for_in_flight_requests_then_stops_only_when_nothing_can_free_room() -> None:
    async def scenario() -> list[str]:
        budget = Budget(cap_usd=1.0, spent_before_usd=0.0, prices_seen=True)
        events: list[str] = []
        await budget.reserve(0.4)
        await budget.reserve(0.4)
        third = asyncio.create_task(budget.reserve(0.4))
        await asyncio.sleep(0)
        events.append(f"third waits: {not third.done()}")
        budget.settle(0.4, 0.1)  # spent 0.1, in flight 0.4: 0.1 + 0.4 + 0.4 fits
        await third
        events.append("third admitted")
        fourth = asyncio.create_task(budget.reserve(0.4))
        await asyncio.sleep(0)
        budget.settle(0.4, 0.3)
        await asyncio.sleep(0)
        events.append(f"fourth still waits: {not fourth.done()}")  # 0.4 + 0.4 in flight + 0.4 > 1
        budget.settle(0.4, 0.3)  # spent 0.7, nothing in flight, 0.7 + 0.4 > 1: no one can free room
        with pytest.raises(BudgetExhausted, match="max_cost_usd"):
            await fourth
        events.append(f"stopped: {budget.stopped}, spent {budget.spent_usd:.1f}, reserved {budget.reserved_usd}")
        with pytest.raises(BudgetExhausted):
            await budget.reserve(0.01)
        return events

    assert asyncio.run(scenario()) == [
        "third waits: True",
        "third admitted",
        "fourth still waits: True",
        "stopped: True, spent 0.7, reserved 0.0",
    ]


def test_budget_without_cap_never_waits() -> None:
    async def scenario() -> float:
        budget = Budget(cap_usd=None, spent_before_usd=2.0)
        for _ in range(1000):
            await budget.reserve(10.0)
            budget.settle(10.0, 0.5)
        return budget.spent_usd

    assert asyncio.run(scenario()) == pytest.approx(502.0)


def test_window_is_fifo_shrinks_once_per_round_trip_and_regrows() -> None:
    async def scenario() -> None:
        window = AdaptiveWindow(max_size=4, min_size=1)
        seqs = [await window.acquire() for _ in range(4)]
        order: list[int] = []

        async def waiter(n: int) -> None:
            await window.acquire()
            order.append(n)

        waiters = [asyncio.create_task(waiter(n)) for n in range(3)]
        await asyncio.sleep(0)
        for seq in seqs:  # four 429s from requests sent under the same limit: one shrink
            window.on_rate_limited(seq, None)
        assert (window.limit, window.shrinks) == (2.0, 1)
        for _ in range(4):
            window.release()
        await asyncio.sleep(0)
        assert order == [0, 1] and window.in_flight == 2, "limit 2 admits two, in arrival order"
        window.on_rate_limited(window._seq, None)  # sent after the shrink: shrinks again
        assert (window.limit, window.shrinks) == (1.0, 2)
        for _ in range(8):
            window.on_success()
        assert window.limit == 3.0
        window.release()
        window.release()
        await asyncio.gather(*waiters)
        assert order == [0, 1, 2]

    asyncio.run(scenario())


def test_retry_after_pauses_every_admission_until_it_passes() -> None:
    async def scenario() -> None:
        window = AdaptiveWindow(max_size=8, min_size=1)
        seq = await window.acquire()
        window.on_rate_limited(seq, 0.2)
        window.release()
        assert window.in_flight == 0 and window.limit == 4.0
        paused = asyncio.create_task(window.acquire())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not paused.done(), "free slots, but the Retry-After pause holds every admission"
        await asyncio.wait_for(paused, timeout=30)
        assert window.in_flight == 1

    asyncio.run(scenario())
