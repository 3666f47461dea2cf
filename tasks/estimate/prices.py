"""Prices per million tokens for the configured model: the config's own, else OpenRouter's public models listing
(`GET <api root>/v1/models`, no key sent) when it is reachable. Nothing here sends a paid request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from tasks.common.config import EndpointConfig


@dataclass(frozen=True)
class Prices:
    prompt_usd_per_mtok: float
    completion_usd_per_mtok: float
    source: str
    known: bool = True


def listing_urls(base_url: str) -> list[str]:
    """Where an OpenRouter-style listing may live for this base_url (`.../api`, `.../api/v1`, a bare host)."""
    base = base_url.rstrip("/").removesuffix("/v1")
    if base.endswith("/api"):
        return [f"{base}/v1/models"]
    return [f"{base}/api/v1/models", f"{base}/v1/models"]


def _per_mtok(value: Any) -> float | None:
    try:
        price = float(value)
    except (TypeError, ValueError):
        return None
    return price * 1e6 if price >= 0 else None


def prices_from_listing(listing: Any, model: str) -> tuple[float, float] | None:
    """(prompt, completion) USD per million tokens of `model` in an OpenRouter `/models` body (USD per token)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for entry in data if isinstance(data, list) else []:
        if not isinstance(entry, dict) or model not in (entry.get("id"), entry.get("canonical_slug")):
            continue
        pricing = entry.get("pricing")
        if not isinstance(pricing, dict):
            return None
        prompt, completion = _per_mtok(pricing.get("prompt")), _per_mtok(pricing.get("completion"))
        if prompt is None or completion is None:
            return None
        return prompt, completion
    return None


def resolve_prices(ep: EndpointConfig, lookup: bool = True, timeout_s: float = 5.0) -> Prices:
    if ep.price_prompt_usd_per_mtok or ep.price_completion_usd_per_mtok:
        return Prices(ep.price_prompt_usd_per_mtok, ep.price_completion_usd_per_mtok, "endpoint.price_*_usd_per_mtok")
    if not lookup:
        return Prices(0.0, 0.0, "no prices configured (lookup off)", known=False)
    reasons = []
    for url in listing_urls(ep.base_url):
        try:
            response = httpx.get(url, timeout=timeout_s)
            if response.status_code != 200:
                reasons.append(f"{url}: HTTP {response.status_code}")
                continue
            found = prices_from_listing(response.json(), ep.model)
        except (httpx.HTTPError, ValueError) as exc:
            reasons.append(f"{url}: {type(exc).__name__}")
            continue
        if found is not None:
            return Prices(found[0], found[1], f"models listing {url}")
        reasons.append(f"{url}: no pricing for {ep.model}")
    if ep.kind == "sglang_generate":
        return Prices(0.0, 0.0, "no prices configured (a self-hosted server: $0)")
    return Prices(0.0, 0.0, "unknown: set endpoint.price_*_usd_per_mtok (" + "; ".join(reasons) + ")", known=False)
