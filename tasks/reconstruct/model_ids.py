"""A completion stored as the ids the model generated, with its loss-mask boundaries found in those ids.

Re-encoding the returned text gives the tokenizer's canonical split; a sampling model emits another split now
and then (SmolLM2 writes `ĊĊ` where re-encoding gives `Ċ Ċ`, `je ur` where it gives `j eur`), so a drafter
trained on re-encoded ids learns sequences the target does not emit. When the endpoint reported the model's
ids (SGLang's `output_ids`, or ids rebuilt from logprobs bytes), they are the row, provided they spell exactly
the completion text the layout gives (else the text was changed after sampling: the row is re-encoded and
validation reports the difference against those ids).

Span boundaries are character offsets of the layout; in the model's ids, a boundary falls before the first
token whose decoded prefix ends past it (a token straddling it joins the later span, as for re-encoded rows).
"""

from __future__ import annotations

from collections.abc import Sequence

from tasks.reconstruct.completion_format import CompletionLayout
from tasks.reconstruct.tokenizer_backend import TokenBackend


def token_at(backend: TokenBackend, ids: Sequence[int], char: int, text_len: int) -> int:
    """Smallest k whose prefix ids[:k+1] decodes past `char` (binary search over prefix decodes)."""
    if char >= text_len:
        return len(ids)
    if char <= 0:
        return 0
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(backend.decode(ids[: mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def model_completion(
    backend: TokenBackend, layout: CompletionLayout, output_ids: Sequence[int], end_of_turn_id: int
) -> tuple[list[int], int, int] | None:
    """(ids, content start, end-of-turn start) of the completion in the model's own ids, or None when they do
    not spell the layout's text. A turn that ended gets its end-of-turn id if the endpoint left it off."""
    ids = [int(t) for t in output_ids]
    if layout.ends_turn and (not ids or ids[-1] != end_of_turn_id):
        ids.append(end_of_turn_id)
    if backend.decode(ids) != layout.text:
        return None
    content_at = token_at(backend, ids, layout.content_start, len(layout.text))
    eot_at = len(ids) - 1 if layout.ends_turn else len(ids)
    if content_at > eot_at:
        return None
    return ids, content_at, eot_at
