"""Several providers behind one simulated endpoint, as OpenRouter routes one model to several hosts.

Each provider is a responder of its own: the target model itself (`model_backend.ModelResponder`), a perturbed
copy of it (weights with noise added: `write_noised_model_dir`; or the same weights at another temperature), or
the word-salad `Responder`. `ProviderPool` picks one per request, the way OpenRouter's `provider` object asks:
`only` and `ignore` narrow the candidates (by name, case and punctuation ignored), `quantizations` keeps the
providers serving one of those, `order` takes the first candidate it names (`allow_fallbacks: false` refuses the
request when it names none); otherwise a stable hash of the request (prompt ids, seed) spreads requests over the
candidates, so a rerun of the same request meets the same provider. The answer's `provider` field names the
provider that served it; a request no provider may serve gets OpenRouter's 404.

Prompts are rendered and tokenized by the first provider's responder: every provider serves the same model
name with the same tokenizer and template, only the weights or the sampling differ.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from endpoint_sim.responder import Responder, SimConfig, SimSample, unit_hash

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class SimProvider:
    """One host of the model: its name (the answer's `provider`), what answers, and the quantization it serves."""

    name: str
    responder: Responder
    quantization: str | None = None


class NoProviderError(LookupError):
    """The request's provider routing leaves no provider to serve it (OpenRouter answers 404)."""


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _names(routing: Mapping[str, Any], field: str) -> list[str] | None:
    value = routing.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NoProviderError(f"provider.{field} must be a list of provider names, got {value!r}")
    return [_slug(v) for v in value]


class ProviderPool(Responder):
    """A `Responder` whose samples come from one of several providers per request (`pick`)."""

    def __init__(self, providers: Sequence[SimProvider]) -> None:
        if not providers:
            raise ValueError("a provider pool needs at least one provider")
        slugs = [_slug(p.name) for p in providers]
        if len(set(slugs)) != len(slugs):
            names = [p.name for p in providers]
            raise ValueError(f"provider names must differ (ignoring case and punctuation): {names}")
        self.providers = list(providers)
        vars(self).update(vars(self.providers[0].responder))  # its tokenizer, special ids and prompt cache
        self.model_backed = any(getattr(p.responder, "model_backed", False) for p in self.providers)

    def update_config(self, config: SimConfig) -> None:
        for provider in self.providers:
            provider.responder.update_config(config)
        self.config = config
        self._prompts = self.providers[0].responder._prompts

    def candidates(self, routing: Mapping[str, Any] | None) -> list[SimProvider]:
        """The providers a request with this `provider` object may be served by, in preference order (the ones
        `order` names first); raises NoProviderError when none may."""
        pool = list(self.providers)
        routing = routing or {}
        if not isinstance(routing, Mapping):
            raise NoProviderError(f"provider must be an object, got {routing!r}")
        only, ignore, order = _names(routing, "only"), _names(routing, "ignore"), _names(routing, "order")
        if only is not None:
            pool = [p for p in pool if _slug(p.name) in only]
        if ignore is not None:
            pool = [p for p in pool if _slug(p.name) not in ignore]
        quantizations = routing.get("quantizations")
        if quantizations is not None:
            wanted = {str(q).lower() for q in quantizations}
            pool = [p for p in pool if p.quantization is not None and p.quantization.lower() in wanted]
        if order is not None:
            named = [p for slug in order for p in pool if _slug(p.name) == slug]
            pool = named if routing.get("allow_fallbacks") is False else named + [p for p in pool if p not in named]
        if not pool:
            raise NoProviderError("No endpoints found matching your provider routing (only/ignore/quantizations/order)")
        return pool

    def pick(self, key: str, routing: Mapping[str, Any] | None = None) -> SimProvider:
        """The provider serving request `key` (= `Responder.key`): `order`'s first candidate, else a stable
        hash over the candidates."""
        pool = self.candidates(routing)
        if routing and routing.get("order"):
            return pool[0]
        return pool[int(unit_hash(key, self.config.seed, "provider") * len(pool))]

    def sample(
        self,
        prompt_ids: tuple[int, ...],
        seed: int | None,
        key: str | None = None,
        routing: Mapping[str, Any] | None = None,
    ) -> SimSample:
        key = key or self.key(prompt_ids, seed)
        provider = self.pick(key, routing)
        return replace(provider.responder.sample(prompt_ids, seed, key), provider=provider.name)

    async def sample_async(
        self,
        prompt_ids: tuple[int, ...],
        seed: int | None,
        key: str | None = None,
        routing: Mapping[str, Any] | None = None,
        limit: int | None = None,
    ) -> SimSample:
        """`sample` for the server's event loop: a model-backed provider batches its forward passes off the loop
        (`endpoint_sim.model_backend`) and decodes up to the request's `limit`, a seeded one answers at once."""
        key = key or self.key(prompt_ids, seed)
        provider = self.pick(key, routing)
        draw = getattr(provider.responder, "sample_async", None)
        if draw is None:
            return replace(provider.responder.sample(prompt_ids, seed, key), provider=provider.name)
        sample = await draw(prompt_ids, seed, key, limit=limit)
        return replace(sample, provider=provider.name)


def write_noised_model_dir(source: Path, target: Path, relative_noise: float, seed: int = 1) -> Path:
    """A copy of the model in `source` whose every weight matrix has Gaussian noise of `relative_noise` times its
    own standard deviation added (norm weights untouched), saved in the source's dtype with the same tokenizer:
    a provider serving damaged weights (a bad quantization, a broken conversion) under the same model name."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, target = Path(source), Path(target)
    saved = getattr(AutoConfig.from_pretrained(str(source), local_files_only=True), "dtype", None)
    dtype = saved if isinstance(saved, torch.dtype) else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, local_files_only=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                noise = torch.randn(param.shape, generator=generator) * (relative_noise * float(param.std()))
                param.add_(noise)
    target.mkdir(parents=True, exist_ok=True)
    model.to(dtype)  # type: ignore[arg-type]  # transformers' wrapped .to() confuses mypy
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target
