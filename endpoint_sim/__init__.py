"""A local stand-in for the target-model endpoint (OpenRouter chat API and SGLang /generate) plus demo assets.

Names are exported lazily so `endpoint_sim.assets` stays importable without loading aiohttp or transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FailureRule",
    "Responder",
    "SimConfig",
    "SimSample",
    "SimulatorServer",
    "request_latency_s",
    "scheduled_failure",
]


def __getattr__(name: str) -> Any:
    if name in ("FailureRule", "Responder", "SimConfig", "SimSample", "request_latency_s", "scheduled_failure"):
        from endpoint_sim import responder

        return getattr(responder, name)
    if name == "SimulatorServer":
        from endpoint_sim.server import SimulatorServer

        return SimulatorServer
    raise AttributeError(f"module 'endpoint_sim' has no attribute {name!r}")
