"""Prices per million tokens for the configured model: the config's own, else OpenRouter's public models listing
(`GET <api root>/v1/models`, no key sent) when it is reachable. Nothing here sends a paid request."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from tasks.common.config import EndpointConfig

PRICE_TOLERANCE_FRAC = 0.005


@dataclass(frozen=True)
class Prices:
    prompt_usd_per_mtok: float
    completion_usd_per_mtok: float
    source: str
    known: bool = True
    disagreement: str | None = None
    """Set when the config's prices differ from the endpoint's own models listing: answers that carry no
    `usage.cost` are recorded at the config's prices, so the recorded spend would not be the bill."""


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


def _listed_prices(ep: EndpointConfig, timeout_s: float) -> tuple[tuple[float, float, str] | None, list[str]]:
    """(prompt, completion, url) from the first listing that prices the model, and why each other one did not."""
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
            return (*found, url), reasons
        reasons.append(f"{url}: no pricing for {ep.model}")
    return None, reasons


def _disagreement(configured: tuple[float, float], listed: tuple[float, float, str]) -> str | None:
    prompt, completion, url = listed
    pairs = ((configured[0], prompt), (configured[1], completion))
    if all(math.isclose(c, x, rel_tol=PRICE_TOLERANCE_FRAC, abs_tol=1e-9) for c, x in pairs):
        return None
    return (
        f"endpoint.price_*_usd_per_mtok (${configured[0]:g} / ${configured[1]:g}) differ from the endpoint's models "
        f"listing {url} (${prompt:g} / ${completion:g}): answers without usage.cost are recorded at the "
        "config's prices, so the recorded spend would not be the bill; set the listed prices"
    )


def listed_price_factor(ep: EndpointConfig, timeout_s: float = 5.0) -> tuple[float, str] | None:
    """How far the endpoint's models listing prices the model above the configured prices (the larger of the
    prompt and completion ratios), with the warning that says so; None when it lists no higher price or nothing
    is configured. The budget counts worst cases at this factor from the first request on."""
    configured = (ep.price_prompt_usd_per_mtok, ep.price_completion_usd_per_mtok)
    if not any(configured):
        return None
    listed = _listed_prices(ep, timeout_s)[0]
    if listed is None:
        return None
    ratios = [x / c if c > 0 else (math.inf if x > 0 else 1.0) for c, x in zip(configured, listed[:2], strict=True)]
    factor = max(ratios)
    if factor <= 1.0 + PRICE_TOLERANCE_FRAC or math.isinf(factor):
        return None
    prompt, completion, url = listed
    return factor, (
        f"the endpoint's models listing {url} prices {ep.model} at ${prompt:g} / ${completion:g} per Mtok, above "
        f"the configured ${configured[0]:g} / ${configured[1]:g}"
    )


def resolve_prices(ep: EndpointConfig, lookup: bool = True, timeout_s: float = 5.0) -> Prices:
    """The config's prices, checked against the endpoint's listing when it has one (`lookup`); else the listing's."""
    if ep.price_prompt_usd_per_mtok or ep.price_completion_usd_per_mtok:
        configured = (ep.price_prompt_usd_per_mtok, ep.price_completion_usd_per_mtok)
        listed = _listed_prices(ep, timeout_s)[0] if lookup else None
        note = _disagreement(configured, listed) if listed is not None else None
        return Prices(*configured, "endpoint.price_*_usd_per_mtok", disagreement=note)
    if not lookup:
        return Prices(0.0, 0.0, "no prices configured (lookup off)", known=False)
    found, reasons = _listed_prices(ep, timeout_s)
    if found is not None:
        return Prices(found[0], found[1], f"models listing {found[2]}")
    if ep.kind == "sglang_generate":
        return Prices(0.0, 0.0, "no prices configured (a self-hosted server: $0)")
    return Prices(0.0, 0.0, "unknown: set endpoint.price_*_usd_per_mtok (" + "; ".join(reasons) + ")", known=False)
