"""Offline acceptance of an EAGLE-3 drafter, with transformers and the drafter's own modules only.

Indexing (as in speculators' `shift_batch`): the drafter's row i pairs the target's aux state g_i (from the
prefix x_0..x_i) with the embedding of x_{i+1} and predicts x_{i+2}; its position id is i + 1, and draft step k
of a chain adds k. A verify step whose newest token is x_m (the target's own) therefore runs the drafter's step 0
over rows 0..m-1 (a causal pass that fills a KV cache), then K - 1 single-row steps, each attending to that cache
and to the chain so far, fed its previous draft token and its previous output state (post-norm when the drafter
was trained with `norm_output`). Step 0 is causal, so one pass over a whole sequence serves every verify step of
it (`Drafter.prefix`); each chain masks out the rows after its own and crops its rows off the cache afterwards.
This is real EAGLE-3 drafting with a KV cache, written independently of the trainer's test-time-training unroll,
which is what makes the cross-check against the trainer's metric mean something.

Two measurements share `Drafter.propose`:

- `acceptance_walk`: the target decodes greedily from a held-out prompt; at every verify step the drafter proposes
  K tokens, greedy chain verification accepts the longest prefix equal to the target's tokens, and the target adds
  its bonus token. Because the target is deterministic, its greedy continuation and its aux states along it are
  computed once, up front: the walk over them is exactly what speculative decoding would do, step for step.
- `teacher_forced`: the trainer's own validation metric recomputed: every loss-masked position of a held-out row
  starts a chain whose step k is fed the data's token (teacher forcing) and is correct when it equals the
  target's argmax over the draft vocabulary (what speculators' `compute_metrics` compares against), counted
  with the same masks and chaining (`full_acc_k`, `cond_acc_k`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasks.common.torch_threads import available_cpus, torch_threads
from tasks.evaluate.interval import accepted_length_interval
from tasks.extract.hf_backend import HFHiddenStateRunner

DECODE_BATCH = 48
"""Held-out prompts the target decodes together: SmolLM2-135M's 48-token decodes of the demo's 48 held-out prompts
took 28-37 s batched (the forward-pass check included) against 168-173 s one by one on 2 cores (4.7-6.1x), all 48
identical (`bench/real_demo_speed.py`)."""


@dataclass
class WalkStats:
    """Verify steps of greedy chain verification, K drafts each (fewer at the very end of an answer)."""

    k: int
    verify_steps: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.proposed_at = self.proposed_at or [0] * self.k
        self.reached_at = self.reached_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    def add(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.accepted_tokens += accepted
        for j in range(proposed):
            self.proposed_at[j] += 1
        for j in range(min(accepted + 1, proposed)):
            self.reached_at[j] += 1  # draft j was proposed and every earlier one accepted
        for j in range(accepted):
            self.accepted_at[j] += 1

    def as_dict(self) -> dict[str, Any]:
        steps = max(self.verify_steps, 1)
        return {
            "k": self.k,
            "verify_steps": self.verify_steps,
            "mean_accepted_length": self.accepted_tokens / steps,
            "tokens_per_verify_step": (self.accepted_tokens + self.verify_steps) / steps,
            # P(draft j accepted | drafts < j accepted and draft j proposed)
            "per_position_acceptance": [
                self.accepted_at[j] / self.reached_at[j] if self.reached_at[j] else 0.0 for j in range(self.k)
            ],
            # P(drafts 1..j all accepted) over the verify steps that proposed draft j
            "per_position_accepted_rate": [
                self.accepted_at[j] / self.proposed_at[j] if self.proposed_at[j] else 0.0 for j in range(self.k)
            ],
        }


class Drafter:
    """An `Eagle3DraftModel` (speculators' own class and checkpoint) driven token by token."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        cfg = model.config
        self.norm_output = bool(cfg.norm_output)
        self.d2t: torch.Tensor | None = getattr(model, "d2t", None)
        self.t2d: torch.Tensor | None = getattr(model, "t2d", None)
        self.uses_draft_vocab = self.d2t is not None and int(self.d2t.numel()) != int(
            cfg.transformer_layer_config.vocab_size
        )

    @classmethod
    def load(cls, checkpoint: Path | str) -> Drafter:
        """The trainer's own loader; attention as sdpa (the attention implementation is never serialized)."""
        from speculators.models.eagle3 import Eagle3DraftModel

        config = Eagle3DraftModel.config_class.from_pretrained(str(checkpoint))
        config.transformer_layer_config._attn_implementation = "sdpa"
        model = Eagle3DraftModel.from_pretrained(str(checkpoint), config=config)
        return cls(model.float())

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if not self.uses_draft_vocab or self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_argmax(self, target_logits: torch.Tensor) -> torch.Tensor:
        """argmax of target logits over the draft vocabulary, as a target id (the trainer's comparison)."""
        if not self.uses_draft_vocab or self.t2d is None:
            return target_logits.argmax(-1)
        masked = target_logits.masked_fill(~self.t2d.bool(), float("-inf"))
        return masked.argmax(-1)

    def _layers(
        self, inputs: torch.Tensor, positions: torch.Tensor, cache: Any, mask: torch.Tensor, start: int
    ) -> torch.Tensor:
        m = self.model
        hidden = inputs
        embeddings = m.rotary_emb(hidden, positions)
        cache_position = torch.arange(start, start + inputs.shape[1])
        for layer in m.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                cache_position=cache_position,
                position_embeddings=embeddings,
            )
        return hidden

    def _head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocab, the state fed to the next step)."""
        m = self.model
        if self.norm_output:
            hidden = m.norm(hidden)
            return m.lm_head(hidden), hidden
        return m.lm_head(m.norm(hidden)), hidden

    @torch.inference_mode()
    def prefix(self, aux: torch.Tensor, ids: Sequence[int], rows: int) -> Prefix:
        """Draft step 0 over rows 0..rows-1 in one causal pass (row i pairs g_i with x_{i+1}). Causality makes row
        i's output and KV exactly what a pass over rows 0..i alone gives, so every chain of a sequence reuses it."""
        from transformers import DynamicCache

        mod = self.model
        features = aux[:rows].float().unsqueeze(0)
        if mod.input_norm is not None:
            features = mod.input_norm(features)
        if mod.fc_norm is not None:
            chunks = features.chunk(len(mod.fc_norm), dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(mod.fc_norm, chunks, strict=True)], dim=-1)
        features = mod.fc(features)
        tokens = torch.as_tensor(list(ids[1 : rows + 1]), dtype=torch.long).unsqueeze(0)
        inputs = torch.cat([mod.embed_tokens(tokens).float(), features], dim=-1)
        positions = torch.arange(1, rows + 1).unsqueeze(0)
        cache = DynamicCache()
        causal = torch.ones(rows, rows, dtype=torch.bool).tril().view(1, 1, rows, rows)
        hidden = self._layers(inputs, positions, cache, causal, 0)
        return Prefix(cache, hidden[0], rows)

    @torch.inference_mode()
    def propose(self, prefix: Prefix, m: int, k: int, feed: Sequence[int] | None = None) -> list[int]:
        """K draft tokens (target ids) for x_{m+1}..x_{m+k} of a verify step whose newest token is x_m.

        Step 0 is row m-1 of `prefix`; step s >= 1 is one new row at position m + s that attends to the prefix's
        rows 0..m-1 and the chain's earlier rows (the cache holds later prefix rows too: they are masked out, and
        the chain's rows are cropped off afterwards). `feed` (teacher forcing) replaces the drafter's own tokens
        as the inputs of steps 1..k-1.
        """
        mod = self.model
        cache, rows = prefix.cache, prefix.rows
        hidden = prefix.hidden[m - 1 : m].unsqueeze(0)
        drafts: list[int] = []
        try:
            for step in range(k):
                logits, state = self._head(hidden)
                token = int(self.to_target_ids(logits[0, -1].argmax(-1)))
                drafts.append(token)
                if step == k - 1:
                    break
                fed = token if feed is None else int(feed[step])
                inputs = torch.cat([mod.embed_tokens(torch.tensor([[fed]])).float(), state], dim=-1)
                mask = torch.zeros(1, 1, 1, rows + step + 1, dtype=torch.bool)
                mask[..., :m] = True
                mask[..., rows:] = True
                hidden = self._layers(inputs, torch.tensor([[m + step + 1]]), cache, mask, rows + step)
        finally:
            extra = cache.get_seq_length() - rows
            if extra > 0:
                cache.crop(-extra)
        return drafts


@dataclass
class Prefix:
    """Draft step 0 over a sequence: its KV cache and per-row output states."""

    cache: Any
    hidden: torch.Tensor
    rows: int


@dataclass
class Target:
    """The target model (transformers) with the extract stage's own aux-state capture. Its greedy decodes and
    states are kept per prompt: the trained and the untrained drafter walk the same continuations."""

    model: Any
    runner: HFHiddenStateRunner
    _greedy: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)
    _aux: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def load(cls, model_dir: Path | str, layers: Sequence[int] | None, dtype: str = "bfloat16") -> Target:
        """Inside `shared_targets()`, one target per model, layers and dtype, with its decodes: evaluations of two
        drafters of one target (the real-model demo's two arms) walk the same greedy decodes, so the second does
        not decode again. The key includes the files' sizes and mtimes, so a rebuilt model directory is loaded
        afresh. Outside it every call loads its own (nothing outlives the evaluation that loaded it)."""
        path = Path(model_dir).resolve()
        key = (str(path), tuple(layers) if layers is not None else None, dtype, _files_stamp(path))
        kept = _SHARED[-1].get(key) if _SHARED else None
        if kept is None:
            runner = HFHiddenStateRunner.load(path, layers=layers, dtype=dtype, device="cpu")
            kept = cls(runner._model, runner)
            if _SHARED:
                _SHARED[-1][key] = kept
        return kept

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = self._decode(prompt, max_new_tokens)
        return list(self._greedy[key])

    @torch.inference_mode()
    def decode_all(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = DECODE_BATCH
    ) -> dict[str, int]:
        """Greedy decodes of every prompt not decoded yet, `batch_size` at a time (left-padded), each kept only
        when every token it generated is the argmax of the target's own forward pass over that sequence alone;
        a decode that is not (padding shifts the float sums, and a near-tie can flip) is decoded again on its own,
        as `greedy` does. One token step for a batch costs little more than for one prompt on a CPU, so this is
        what makes a walk over many prompts cheap. Returns how many were decoded batched and how many again."""
        todo = list(dict.fromkeys(tuple(p) for p in prompts if (tuple(p), max_new_tokens) not in self._greedy))
        todo.sort(key=len)  # neighbours in length share a batch: less left padding to compute over
        counts = {"batched": 0, "redecoded": 0}
        with torch_threads(available_cpus()):
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                for prompt, seq in zip(chunk, self._decode_batch(chunk, max_new_tokens), strict=True):
                    if not self._is_greedy(seq, len(prompt)):
                        seq = self._decode(prompt, max_new_tokens)
                        counts["redecoded"] += 1
                    else:
                        counts["batched"] += 1
                    self._greedy[(prompt, max_new_tokens)] = seq
        return counts

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        return {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}

    def _decode_batch(self, prompts: Sequence[tuple[int, ...]], max_new_tokens: int) -> list[list[int]]:
        eos = self._eos_ids()
        pad = self.model.config.pad_token_id
        pad = int(pad) if pad is not None else min(eos, default=0)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with self.runner.hooks_paused():
            out = self.model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
        decoded = []
        for prompt, row in zip(prompts, out[:, width:].tolist(), strict=True):
            new: list[int] = []
            for token in row:
                new.append(int(token))
                if token in eos:
                    break
            decoded.append([*prompt, *new])
        return decoded

    def _is_greedy(self, seq: Sequence[int], prompt_len: int) -> bool:
        with self.runner.hooks_paused():
            logits = self.model(input_ids=torch.tensor([list(seq)])).logits[0]
        chosen = logits[prompt_len - 1 : len(seq) - 1].argmax(-1).tolist()
        return [int(t) for t in chosen] == [int(t) for t in seq[prompt_len:]]

    def _decode(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        with self.runner.hooks_paused():
            out = self.model.generate(
                torch.tensor([list(prompt)]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.model.config.pad_token_id,
            )
        return [int(t) for t in out[0].tolist()]

    @torch.inference_mode()
    def states(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, 3H] exactly as extract stores them, logits [T, V])."""
        captured = self.runner.run_batch([list(ids)], [0])
        with self.runner.hooks_paused():
            logits = self.model(input_ids=torch.tensor([list(ids)])).logits[0].float()
        return captured.aux, logits

    @torch.inference_mode()
    def aux(self, ids: Sequence[int]) -> torch.Tensor:
        """The aux states of a sequence the walks revisit (kept; the logits, vocabulary-wide, are not)."""
        key = tuple(ids)
        if key not in self._aux:
            self._aux[key] = self.runner.run_batch([list(ids)], [0]).aux
        return self._aux[key]


_SHARED: list[dict[tuple[Any, ...], Target]] = []


@contextmanager
def shared_targets() -> Iterator[None]:
    """While active, `Target.load` hands out one target (and its greedy decodes) per model, layers and dtype."""
    _SHARED.append({})
    try:
        yield
    finally:
        _SHARED.pop()


def _files_stamp(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    if not model_dir.is_dir():
        return ()
    return tuple(
        (p.name, st.st_size, st.st_mtime_ns) for p in sorted(model_dir.iterdir()) if p.is_file() for st in [p.stat()]
    )


def acceptance_walk(
    target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int
) -> dict[str, Any]:
    """Greedy chain verification along the target's decodes; `target_decodes` says how many of them this walk
    made batched and how many it decoded again alone after the check (none where an earlier walk's are kept);
    `per_prompt`: [accepted drafts, verify steps] of each prompt in order, what an interval over prompts resamples
    (`tasks.evaluate.interval`)."""
    stats = WalkStats(k)
    generated = 0
    per_prompt: list[list[int]] = []
    decoded = target.decode_all(prompts, max_new_tokens)
    for prompt in prompts:
        before = (stats.accepted_tokens, stats.verify_steps)
        seq = target.greedy(prompt, max_new_tokens)
        aux = target.aux(seq)
        n, m = len(seq), len(prompt)
        generated += n - m
        prefix = drafter.prefix(aux, seq, n - 1)
        while m + 1 < n:
            proposed = min(k, n - 1 - m)
            drafts = drafter.propose(prefix, m, proposed)
            accepted = 0
            while accepted < proposed and drafts[accepted] == seq[m + 1 + accepted]:
                accepted += 1
            stats.add(proposed, accepted)
            m += accepted + 1
        per_prompt.append([stats.accepted_tokens - before[0], stats.verify_steps - before[1]])
    return {
        **stats.as_dict(),
        "prompts": len(prompts),
        "generated_tokens": generated,
        "target_decodes": decoded,
        "per_prompt": per_prompt,
        "mean_accepted_length_interval_95": list(accepted_length_interval(per_prompt)) if stats.verify_steps else None,
    }


def teacher_forced(
    target: Target, drafter: Drafter, rows: Sequence[tuple[Sequence[int], Sequence[int]]], k: int
) -> dict[str, Any]:
    """speculators' `full_acc_k` / `cond_acc_k` over (input_ids, loss_mask) rows, recomputed independently."""
    correct = [0] * k
    full_total = [0] * k
    cond_total = [0] * k
    for ids, mask in rows:
        aux, logits = target.states(ids)
        greedy = drafter.draft_vocab_argmax(logits).tolist()  # greedy[j]: target's choice for x_{j+1}
        n = len(ids)
        prefix = drafter.prefix(aux, ids, n - 1)
        # shifted rows i = 0..n-2 pair g_i with x_{i+1}; row i's loss mask is mask[i + 1]
        for j in range(k):
            full_total[j] += sum(int(mask[i + 1 + j]) for i in range(n - 1 - j))
        for m in range(1, n):
            if not mask[m]:
                continue
            steps = min(k, n - m)
            feed = [ids[m + s] for s in range(1, steps)]
            drafts = drafter.propose(prefix, m, steps, feed=feed)
            for s in range(steps):
                cond_total[s] += 1
                if drafts[s] != greedy[m + s]:
                    break
                if mask[m + s]:
                    correct[s] += 1
    return {
        "k": k,
        "rows": len(rows),
        "full_acc": [c / t if t else 0.0 for c, t in zip(correct, full_total, strict=True)],
        "cond_acc": [c / t if t else 0.0 for c, t in zip(correct, cond_total, strict=True)],
        "positions": full_total[0],
    }
