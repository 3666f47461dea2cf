"""The simulator backed by a causal LM: every answer is the tokens that model really produced for the prompt.

`ModelResponder` replaces the word-salad text of `Responder._build` with a decode of any local causal LM (the
tiny random-weight Llama of `endpoint_sim.assets`, SmolLM2-135M-Instruct of `endpoint_sim.smollm2`, or a model
object the caller already loaded): greedy at `temperature == 0`, otherwise sampled with temperature / top-p from
a generator seeded per (prompt, seed) key, so an answer is reproducible whatever else is decoded beside it.
Both routes serve it: chat completions return the decoded text (with per-token logprobs and bytes on request),
`/generate` the same text plus the model's own `output_ids`.

Two answer shapes (`stop`):
- "model": the model ends its own turn: decoding stops at its end-of-turn id (the tokenizer's eos and the
  model's generation-config eos ids) or at the request's token limit (`max_tokens`, `max_new_tokens`; at most
  the backend's own `max_new_tokens`), and then the answer is "length". Every token is the model's choice,
  non-canonical splits and partial UTF-8 pieces included: what a real serving stack returns.
  With a tokenizer that has a single `</think>` token the reasoning is what precedes the model's own `</think>`.
- "forced": a random-weight model never stops thinking or ends its turn, so the shape comes from the simulator's
  knobs: `reasoning_words` tokens, then `</think>`, then `content_words` tokens, then the end of turn. Its choices
  are restricted to ordinary tokens that decode to complete UTF-8 on their own, so the text round-trips.
The default picks "forced" for a tokenizer with a `</think>` token (the demo's tiny thinking target) and
"model" otherwise.

Requests are decoded in batches: a worker thread takes up to `batch_size` queued prompts, left-pads them and
decodes them together with a KV cache, each row with its own generator, and hands every answer back the moment
its row ends. torch releases the GIL, so the server's event loop keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from endpoint_sim.responder import REASONING_CLOSE, Responder, SimConfig, SimSample, _rng, unit_hash
from tasks.common.torch_threads import torch_threads as scoped_torch_threads

Stop = Literal["model", "forced"]
DEFAULT_MAX_NEW_TOKENS = 512
BATCH_LINGER_S = 0.05
"""How long the first queued prompt waits for others to share its batch (requests arrive together)."""


@dataclass
class _Row:
    key: str
    prompt_ids: tuple[int, ...]
    future: Future[SimSample]
    generator: torch.Generator
    cap: int
    """tokens this decode may produce: the request's limit, at most the backend's `max_new_tokens`"""
    forced_close_at: int | None = None
    forced_length: int | None = None


class ModelResponder(Responder):
    """A `Responder` whose samples are decoded by a causal LM (on the CPU unless `model` lives elsewhere)."""

    model_backed = True

    def __init__(
        self,
        model_dir: Path | str,
        config: SimConfig | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        torch_threads: int = 1,
        *,
        model: Any = None,
        stop: Stop | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        batch_size: int = 16,
    ) -> None:
        """`model`: an already-loaded causal LM to decode with (the tokenizer still comes from `model_dir`);
        `stop`: the answer shape (see the module docstring); `max_new_tokens`: the decode's own cap."""
        super().__init__(model_dir, config)
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"model backend needs temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
        self.temperature = temperature
        self.top_p = top_p
        self.torch_threads = torch_threads
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.stop: Stop = stop or ("forced" if self.reasoning_close_id is not None else "model")
        if self.stop == "forced" and self.reasoning_close_id is None:
            raise ValueError(f"{model_dir}: stop='forced' needs a tokenizer with a single {REASONING_CLOSE!r} token")
        if model is None:
            from transformers import AutoModelForCausalLM

            # float32: CPU bf16 matmuls are several times slower
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
        self.model: Any = model
        self.model.eval()
        self.device = next(self.model.parameters()).device
        vocab = int(self.model.config.vocab_size)
        self.allowed = self._allowed_ids(vocab) if self.stop == "forced" else None
        self.stop_ids = self._stop_ids()
        self.pad_id = self.eos_id
        self.lock = threading.Lock()
        self._queue: queue.Queue[_Row] = queue.Queue()
        self._pending: dict[str, Future[SimSample]] = {}
        self._pending_lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def _stop_ids(self) -> frozenset[int]:
        ids = {self.eos_id}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, list | tuple):
            ids.update(int(i) for i in configured)
        return frozenset(ids)

    def _allowed_ids(self, vocab_size: int) -> torch.Tensor:
        """[vocab] bool: ordinary tokens that decode to complete UTF-8 text on their own."""
        special = self._special_ids
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        for token_id in range(min(vocab_size, len(self.tokenizer))):
            if token_id in special:
                continue
            text = self.tokenizer.decode([token_id])
            if text and "\ufffd" not in text and REASONING_CLOSE not in text:
                allowed[token_id] = True
        return allowed

    # -- requests -------------------------------------------------------------------------------------------

    def sample(
        self, prompt_ids: tuple[int, ...], seed: int | None, key: str | None = None, limit: int | None = None
    ) -> SimSample:
        """Blocking: the cached sample, or one decoded in the next batch. `limit`: the request's token limit;
        the decode stops there (a longer answer is cut at the limit anyway), so a cached shorter cut is
        decoded again for a request with a higher limit."""
        key = key or self.key(prompt_ids, seed)
        while True:
            cached = self._samples.get(key)
            if cached is not None and self._serves(cached, limit):
                return cached
            sample = self._submit(key, prompt_ids, limit).result()
            if self._serves(sample, limit):
                return sample

    async def sample_async(
        self, prompt_ids: tuple[int, ...], seed: int | None, key: str | None = None, limit: int | None = None
    ) -> SimSample:
        """For the server's event loop: waits for the batch worker without holding an executor thread."""
        key = key or self.key(prompt_ids, seed)
        while True:
            cached = self._samples.get(key)
            if cached is not None and self._serves(cached, limit):
                return cached
            # shielded: a client that gives up cancels its handler, and the decode must still finish for its retry
            sample = await asyncio.shield(asyncio.wrap_future(self._submit(key, prompt_ids, limit)))
            if self._serves(sample, limit):
                return sample

    def _cap(self, limit: int | None) -> int:
        return self.max_new_tokens if limit is None else max(1, min(limit, self.max_new_tokens))

    def _serves(self, sample: SimSample, limit: int | None) -> bool:
        """A finished answer serves every limit; a cut one only limits up to where it was cut."""
        return sample.finished or len(sample.output_ids) >= self._cap(limit)

    def _submit(self, key: str, prompt_ids: tuple[int, ...], limit: int | None = None) -> Future[SimSample]:
        """A decode of `prompt_ids` up to the request's limit; a decode of the same key already running is shared
        (a client retry), and the caller decodes again if that one was cut shorter than it needs."""
        with self._pending_lock:
            pending = self._pending.get(key)
            if pending is not None and not pending.cancelled():
                return pending
            future: Future[SimSample] = Future()
            self._pending[key] = future
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="model-backend", daemon=True)
                self._worker.start()
        self._queue.put(self._row(key, prompt_ids, future, self._cap(limit)))
        return future

    def _row(self, key: str, prompt_ids: tuple[int, ...], future: Future[SimSample], cap: int) -> _Row:
        cfg = self.config
        generator = torch.Generator().manual_seed(int(unit_hash(key, cfg.seed, "model-sampling") * 2**62))
        row = _Row(key, prompt_ids, future, generator, cap)
        if self.stop == "forced":
            shape = _rng(key, cfg.seed, "model-shape")
            n_reasoning = shape.randint(*cfg.reasoning_words)
            row.forced_close_at = n_reasoning
            row.forced_length = n_reasoning + 1 + shape.randint(*cfg.content_words)
        return row

    def _work(self) -> None:
        while True:
            rows = [self._queue.get()]
            deadline = time.monotonic() + BATCH_LINGER_S
            while len(rows) < self.batch_size:
                try:
                    rows.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                with self.lock, scoped_torch_threads(self.torch_threads):
                    self._decode(rows)
            except BaseException as exc:  # every waiter hears about it; the worker goes on with the next batch
                for row in rows:
                    self._deliver_error(row, exc)

    def _deliver(self, row: _Row, sample: SimSample) -> None:
        self._samples.put(row.key, sample)
        with self._pending_lock:
            if self._pending.get(row.key) is row.future:
                del self._pending[row.key]
        if not row.future.done() and row.future.set_running_or_notify_cancel():
            row.future.set_result(sample)

    def _deliver_error(self, row: _Row, exc: BaseException) -> None:
        with self._pending_lock:
            if self._pending.get(row.key) is row.future:
                del self._pending[row.key]
        if not row.future.done() and row.future.set_running_or_notify_cancel():
            row.future.set_exception(exc)

    # -- decoding -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, rows: list[_Row]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompts of `rows`, left-padded, through the model: (KV cache, attention mask, last position per row,
        next-token logits per row)."""
        width = max(len(r.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
        )
        return out.past_key_values, mask, positions[:, -1:], out.logits[:, -1].float().cpu()

    @staticmethod
    def _joinable(past: Any) -> bool:
        return all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in getattr(past, "layers", [None]))

    @staticmethod
    def _join(
        a: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two running batches as one: the shorter cache (and its mask) left-padded to the longer, then stacked."""
        (past_a, mask_a, pos_a, logits_a), (past_b, mask_b, pos_b, logits_b) = a, b
        width = max(mask_a.shape[1], mask_b.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for layer_a, layer_b in zip(past_a.layers, past_b.layers, strict=True):
            layer_a.keys = torch.cat([pad(layer_a.keys, 2), pad(layer_b.keys, 2)], dim=0)
            layer_a.values = torch.cat([pad(layer_a.values, 2), pad(layer_b.values, 2)], dim=0)
        mask = torch.cat([pad(mask_a, 1), pad(mask_b, 1)], dim=0)
        return past_a, mask, torch.cat([pos_a, pos_b]), torch.cat([logits_a, logits_b])

    @staticmethod
    def _crop(past: Any, mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Drop the leading cache columns no remaining row attends to (the rows that left were the oldest).

        Without this a running batch only ever widens: every step adds a column and every joining row is padded
        to the batch's width, so each step attends over more padded columns the longer the batch runs (96 queued
        SmolLM2 prompts of 64 tokens decoded 10% faster with the crop, to identical ids). Positions are explicit,
        so cropping padding changes no logit."""
        used = mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1]
        if first == 0:
            return past, mask
        for layer in past.layers:
            layer.keys = layer.keys[:, :, first:].contiguous()
            layer.values = layer.values[:, :, first:].contiguous()
        return past, mask[:, first:]

    def _waiting(self, room: int) -> list[_Row]:
        rows: list[_Row] = []
        while len(rows) < room:
            try:
                rows.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return rows

    @torch.inference_mode()
    def _decode(self, rows: list[_Row]) -> None:
        """Decode `rows` step by step with a KV cache, as one left-padded batch that rows leave the moment they end
        (each is delivered at once) and queued rows join between steps (continuous batching), until none runs."""
        rows = list(rows)
        past, mask, positions, logits = self._prefill(rows)
        joinable = self._joinable(past)
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        live = list(range(len(rows)))  # batch row b decodes rows[live[b]]
        while live:
            chosen, keep = [], []
            for b, i in enumerate(live):
                token, logprob = self._next(rows[i], len(tokens[i]), logits[b])
                tokens[i].append(token)
                logprobs[i].append(logprob)
                if self._ended(rows[i], tokens[i], token):
                    self._deliver(rows[i], self._sample(rows[i], tokens[i], logprobs[i]))
                else:
                    chosen.append(token)
                    keep.append(b)
            if keep:
                if len(keep) < len(live):
                    index = torch.tensor(keep, dtype=torch.long)
                    past.batch_select_indices(index.to(self.device))
                    mask, positions = mask[index], positions[index]
                    live = [live[b] for b in keep]
                    if joinable:
                        past, mask = self._crop(past, mask)
                mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
                positions = positions + 1
                out = self.model(
                    input_ids=torch.tensor(chosen, dtype=torch.long).unsqueeze(1).to(self.device),
                    attention_mask=mask.to(self.device),
                    position_ids=positions.to(self.device),
                    past_key_values=past,
                    use_cache=True,
                )
                past, logits = out.past_key_values, out.logits[:, -1].float().cpu()
            else:
                live = []
            joining = self._waiting(self.batch_size - len(live)) if joinable or not live else []
            if joining:
                start = len(rows)
                rows += joining
                tokens += [[] for _ in joining]
                logprobs += [[] for _ in joining]
                fresh = self._prefill(joining)
                if live:
                    past, mask, positions, logits = self._join((past, mask, positions, logits), fresh)
                else:
                    past, mask, positions, logits = fresh
                live += range(start, len(rows))

    def _next(self, row: _Row, step: int, logits: torch.Tensor) -> tuple[int, float]:
        """The row's token at `step` and the model's log-probability of it."""
        log_probs = torch.log_softmax(logits, dim=-1)
        if row.forced_close_at is not None and step == row.forced_close_at:
            assert self.reasoning_close_id is not None
            return self.reasoning_close_id, float(log_probs[self.reasoning_close_id])
        scores = logits if self.allowed is None else logits.masked_fill(~self.allowed, float("-inf"))
        if self.temperature == 0:
            token = int(scores.argmax())
        else:
            probs = torch.softmax(scores / self.temperature, dim=-1)
            if self.top_p < 1:
                sorted_probs, order = probs.sort(descending=True)
                keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p
                probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
            token = int(torch.multinomial(probs, 1, generator=row.generator))
        return token, float(log_probs[token])

    def _ended(self, row: _Row, tokens: list[int], token: int) -> bool:
        if row.forced_length is not None:
            return len(tokens) >= row.forced_length
        return token in self.stop_ids or len(tokens) >= row.cap

    def _sample(self, row: _Row, tokens: list[int], logprobs: list[float]) -> SimSample:
        cfg = self.config
        provider = cfg.providers[int(unit_hash(row.key, cfg.seed, "provider") * len(cfg.providers))]
        if row.forced_length is not None:
            output, lps, finished = (*tokens, self.eos_id), (*logprobs, 0.0), True
        else:
            finished = tokens[-1] in self.stop_ids
            if finished and tokens[-1] != self.eos_id:
                tokens = [*tokens[:-1], self.eos_id]  # one end of turn, the one the formats know
            output, lps = tuple(tokens), tuple(logprobs)
        body = list(output[:-1] if finished else output)
        close = self.reasoning_close_id
        if close is not None and close in body:
            cut = body.index(close)
            reasoning, content, reasoning_tokens = self.decode(body[:cut]), self.decode(body[cut + 1 :]), cut
        elif close is not None:
            reasoning, content, reasoning_tokens = self.decode(body), "", len(body)
        else:
            reasoning, content, reasoning_tokens = "", self.decode(body), 0
        return SimSample(
            key=row.key,
            prompt_ids=row.prompt_ids,
            reasoning=reasoning,
            content=content,
            output_ids=output,
            canonical_ids=output,
            reasoning_tokens=reasoning_tokens,
            provider=provider,
            has_tool_call=False,
            noncanonical=False,
            text_mismatch=False,
            has_reasoning=close is not None,
            finished=finished,
            logprobs=lps,
        )

    def _build(self, key: str, prompt_ids: tuple[int, ...]) -> SimSample:
        return self.sample(prompt_ids, None, key)
