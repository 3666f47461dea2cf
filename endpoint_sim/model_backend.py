"""The simulator backed by the target model itself: answers are tokens the tiny model really produced.

`ModelResponder` replaces the word-salad text of `Responder._build` with a decode of the target model (the tiny
random-weight Llama of `endpoint_sim.assets`, or any local causal LM): greedy at `temperature == 0`, otherwise
sampled with temperature / top-p from a generator seeded per (prompt, seed) key, so an answer is reproducible.
Both routes serve it: chat-completions returns the decoded reasoning and content, `/generate` the same text plus
the model's own `output_ids`.

A random-weight model never chooses to stop thinking or to end its turn, so the answer's shape comes from the
simulator's knobs: the model decodes `reasoning_words` (read as tokens) tokens, then `</think>` is emitted, then
`content_words` tokens, then the end-of-sentence token. Tokens the model may choose are restricted to ordinary
vocabulary entries whose bytes decode to complete UTF-8 on their own (no special or added tokens, no partial
multi-byte pieces), so the answer's text round-trips through the tokenizer to the same string: what validation
then sees are genuine BPE re-segmentations, never mangled text.

The decode runs in a worker thread (`asyncio.to_thread` in the server) under one lock, with one torch thread;
torch releases the GIL, so the event loop keeps answering health checks meanwhile.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from endpoint_sim.responder import REASONING_CLOSE, Responder, SimConfig, SimSample, _rng, unit_hash
from tasks.common.torch_threads import torch_threads as scoped_torch_threads


class ModelResponder(Responder):
    """A `Responder` whose samples are decoded by the causal LM in `model_dir` (on the CPU)."""

    model_backed = True

    def __init__(
        self,
        model_dir: Path | str,
        config: SimConfig | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        torch_threads: int = 1,
    ) -> None:
        super().__init__(model_dir, config)
        from transformers import AutoModelForCausalLM

        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"model backend needs temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self.torch_threads = torch_threads
        # float32: CPU bf16 matmuls are several times slower, and the tiny model is small either way
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, local_files_only=True
        )
        self.model.eval()
        self.lock = threading.Lock()
        self.allowed = self._allowed_ids(int(self.model.config.vocab_size))

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

    @torch.inference_mode()
    def decode_tokens(self, prompt_ids: tuple[int, ...], key: str) -> tuple[list[int], list[int]]:
        """(reasoning ids, content ids) the model produces for the prompt, `</think>` and eos not included."""
        cfg = self.config
        shape = _rng(key, cfg.seed, "model-shape")
        n_reasoning = shape.randint(*cfg.reasoning_words)
        n_content = shape.randint(*cfg.content_words)
        generator = torch.Generator().manual_seed(int(unit_hash(key, cfg.seed, "model-sampling") * 2**62))
        with self.lock, scoped_torch_threads(self.torch_threads):
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
            out = self.model(input_ids=ids, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
            reasoning: list[int] = []
            content: list[int] = []
            for step in range(n_reasoning + 1 + n_content):
                if step == n_reasoning:
                    token = self.reasoning_close_id
                else:
                    token = self._choose(logits, generator)
                    (reasoning if step < n_reasoning else content).append(token)
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
        return reasoning, content

    def _choose(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        scores = logits.float().masked_fill(~self.allowed, float("-inf"))
        if self.temperature == 0:
            return int(scores.argmax())
        probs = torch.softmax(scores / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    def _build(self, key: str, prompt_ids: tuple[int, ...]) -> SimSample:
        cfg = self.config
        reasoning_ids, content_ids = self.decode_tokens(prompt_ids, key)
        output = (*reasoning_ids, self.reasoning_close_id, *content_ids, self.eos_id)
        provider = cfg.providers[int(unit_hash(key, cfg.seed, "provider") * len(cfg.providers))]
        return SimSample(
            key=key,
            prompt_ids=prompt_ids,
            reasoning=self.decode(reasoning_ids),
            content=self.decode(content_ids),
            output_ids=output,
            canonical_ids=output,
            reasoning_tokens=len(reasoning_ids),
            provider=provider,
            has_tool_call=False,
            noncanonical=False,
            text_mismatch=False,
        )
