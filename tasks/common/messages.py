"""Conversation normalisation and the stable sample id.

`sample_id` is a content hash of (dataset name, normalised messages): the same prompt in the same dataset gets
the same id on every machine and every rerun, whatever its position in the file. Resume keys on it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypedDict


class Message(TypedDict):
    role: str
    content: str


ROLES = frozenset({"system", "user", "assistant"})


def sample_id(dataset: str, messages: list[Message]) -> str:
    payload = json.dumps(
        {"dataset": dataset, "messages": [[m["role"], m["content"]] for m in messages]},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def response_sample_id(prompt_id: str, sample_index: int) -> str:
    """Id of the k-th response to one prompt. k=0 keeps the prompt's id, so raising `samples_per_prompt` on an
    existing run adds samples and never renames the ones already generated."""
    if sample_index == 0:
        return prompt_id
    return hashlib.sha256(f"{prompt_id}/{sample_index}".encode()).hexdigest()[:32]


def prompt_messages(messages: list[Message] | list[dict[str, Any]]) -> list[Message]:
    """The prompt the target answers: the conversation without its trailing assistant turn(s).

    Datasets often carry some other model's answer as the last turn; the drafter must learn the *target's*
    answer, so that turn is regenerated, never reused.
    """
    out: list[Message] = [Message(role=m["role"], content=m["content"]) for m in messages]
    while out and out[-1]["role"] == "assistant":
        out.pop()
    return out
