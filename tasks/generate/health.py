"""A cheap liveness probe before a generate task starts its window: an endpoint that is down should cost one
task-level retry, not thousands of per-sample attempts that end as 'failed' rows."""

from __future__ import annotations

import httpx

from tasks.common.config import EndpointConfig
from tasks.common.errors import EndpointUnavailableError

UNAVAILABLE_STATUS = frozenset({502, 503, 504})
# Timeouts reported by the server side after the request was accepted (a request timeout, a client-closed
# request, Cloudflare's origin timeout): the upstream may have generated, and billed, the whole answer.
UPSTREAM_TIMEOUT_STATUS = frozenset({408, 499, 524})


def probe_url(cfg: EndpointConfig) -> str:
    if cfg.kind == "sglang_generate":
        return f"{cfg.base_url.removesuffix('/v1')}/health"
    base = cfg.base_url if cfg.base_url.endswith("/v1") else f"{cfg.base_url}/v1"
    return f"{base}/models"


def probe_endpoint(cfg: EndpointConfig, timeout_s: float = 10.0) -> int:
    """Returns the probe's HTTP status. Any answer below 500 means alive (a 401 is for the run to report)."""
    url = probe_url(cfg)
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.TransportError as exc:
        raise EndpointUnavailableError(f"endpoint {url} unreachable: {type(exc).__name__}: {exc}") from exc
    if response.status_code in UNAVAILABLE_STATUS:
        raise EndpointUnavailableError(f"endpoint {url} answered {response.status_code}: not serving yet")
    return response.status_code
