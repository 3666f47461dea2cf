"""A streamed chat completion (Server-Sent Events), folded as its bytes arrive into the body a non-streamed call
returns, so streamed and non-streamed answers go through the same parsing and give the same row.

Built for 10,000 long streams at once on two cores (`bench/stream_throughput.py`): `feed` takes whatever the
socket gave and keeps only the unfinished end; each event is parsed once (orjson, with `json` for what orjson
refuses, such as NaN or half of a UTF-16 pair; orjson's values are `json.loads`'s, but for integers beyond 64 bits,
which it makes floats) and dropped; each text field has one UTF-8 buffer that grows in
place and is decoded once, in `body()`. Nothing per event outlives its `feed`, and no piece is its own object.

Wire format (the SSE spec, as OpenAI and OpenRouter use it): lines end with LF, CRLF or CR; the `data:` lines of
one event are joined with LF, and the event is handled at the blank line that ends it (or at the end of the body);
comment lines (OpenRouter's `: OPENROUTER PROCESSING`) and other fields are skipped; `data: [DONE]` ends the
stream. Usage may come in the finish chunk or in a last chunk with no choices; a mid-stream failure is a chunk
with an `error` object; a stream that ends without a finish_reason is truncated, whatever else arrived. UTF-16
halves of one character sent in two chunks (a server that cuts strings by code units) are joined in `body()`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from orjson import loads as _loads

from tasks.generate.endpoints import MalformedResponseError

ENVELOPE_KEYS = ("id", "provider", "model", "quantization")
LEARN_TRIES = 4
# The learned envelope ends with the choices key; what follows is parsed as an object of its own.
CHOICES_KEY = b',"choices":'
REST_START = b'{"choices":'
_SURROGATE = re.compile("[\ud800-\udfff]")


class StreamAssembler:
    """One stream's state. Hooks: `on_generation_id(id)` is called once, as soon as the generation id is known
    (the first chunk carries it), so the spend ledger records it before the answer ends; `on_choice(choice)` with
    each chunk's first choice, the place to accumulate per-chunk fields such as logprobs."""

    __slots__ = (
        "_by_line",
        "_content",
        "_data",
        "_learn_left",
        "_open",
        "_prefix",
        "_reasoning",
        "_tail",
        "done",
        "error",
        "finish_reason",
        "meta",
        "on_choice",
        "on_generation_id",
        "usage",
    )

    def __init__(
        self,
        on_generation_id: Callable[[str], None] | None = None,
        on_choice: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.on_generation_id = on_generation_id
        self.on_choice = on_choice
        self._reasoning: bytearray | None = None  # None until a reasoning field arrives: then "" is an answer
        self._content = bytearray()
        self._tail = b""
        self._by_line = False
        self._open: bytes | None = None
        self._data: bytes | None = None
        self._prefix = b""
        self._learn_left = LEARN_TRIES
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        self.error: Any = None
        self.done = False

    def feed(self, data: bytes) -> None:
        """The next bytes of the body, cut anywhere.

        With LF line ends (OpenAI's, OpenRouter's) the bytes are split at LF, lines gather into an event until its
        blank line, and an event that is one `data:` line (all of them, in practice) is parsed straight from that
        line. A body with a CR anywhere is read by `_feed_lines`, any line end, from then on."""
        if self._tail:
            data = self._tail + data
            self._tail = b""
        if self._by_line or b"\r" in data:
            if self._open is not None:  # whole lines of an event whose blank line has not come
                data = self._open + b"\n" + data
                self._open = None
            self._by_line = True
            self._feed_lines(data)
            return
        lines = data.split(b"\n")
        self._tail = lines.pop()
        event = self._open
        prefix = self._prefix
        cut = len(prefix)
        for line in lines:
            if line:
                event = line if event is None else event + b"\n" + line
                continue
            if event is None:
                continue
            this, event = event, None
            # A ValueError: [DONE], several lines, or what orjson refuses; `_event_lines` sorts them out.
            if cut and this.startswith(prefix):
                try:
                    chunk = _loads(REST_START + this[cut:])
                except ValueError:
                    self._event_lines(this)
                    continue
                if len(chunk) == 1:  # only "choices": the envelope is the learned one, nothing else rides along
                    self._choice(chunk["choices"], chunk)
                    continue
            elif this[:6] == b"data: ":
                try:
                    chunk = _loads(this[6:])
                except ValueError:
                    self._event_lines(this)
                    if self.done:  # [DONE]: whatever follows is not part of the answer
                        return
                    continue
                if self._learn_left and self._learn(this, chunk):
                    prefix = self._prefix
                    cut = len(prefix)
            else:
                self._event_lines(this)
                continue
            self._chunk(chunk)
        self._open = event

    def close(self) -> None:
        """The body ended: a last line without its line break and an event without its blank line still count
        (a line cut short is then not JSON, and the stream is malformed)."""
        tail, self._tail = self._tail, b""
        if self._by_line:
            if tail:
                self._feed_lines(tail + b"\n")
            if self._data is not None:
                data, self._data = self._data, None
                self._event(data)
            return
        event, self._open = self._open, None
        if tail:
            event = tail if event is None else event + b"\n" + tail
        if event is not None:
            self._event_lines(event)

    def _learn(self, event: bytes, chunk: Any) -> bool:
        """Learn the stream's envelope: the bytes before `"choices"`, which every chunk of a stream repeats (id,
        provider, model, created). A later event that starts with exactly these bytes is parsed from there on, as
        `{"choices": ...}`, a fifth of the parsing saved; its envelope is the one already read. Kept only when the
        two parts parse to exactly the whole chunk; tried again on a chunk that does not match, a few times."""
        self._learn_left -= 1
        at = event.find(CHOICES_KEY)
        if at < 7 or type(chunk) is not dict:
            return False
        try:
            envelope = _loads(event[6:at] + b"}")
            rest = _loads(REST_START + event[at + len(CHOICES_KEY) :])
        except ValueError:
            return False
        if type(envelope) is not dict or type(rest) is not dict or not envelope.keys().isdisjoint(rest):
            return False
        if {**envelope, **rest} != chunk:
            return False
        self._prefix = event[: at + len(CHOICES_KEY)]
        return True

    def _event_lines(self, event: bytes) -> None:
        """One whole event (LF line ends, without its blank line): its data lines joined, then handled."""
        data = [line[6:] if line[5:6] == b" " else line[5:] for line in event.split(b"\n") if line[:5] == b"data:"]
        if data:
            self._event(b"\n".join(data))

    def _feed_lines(self, data: bytes) -> None:
        lines = data.splitlines()
        if data[-1:] not in (b"\n", b"\r"):
            self._tail = lines.pop()
        pending = self._data
        for line in lines:
            if not line:
                if pending is not None:
                    self._event(pending)
                    pending = None
                    if self.done:
                        break
            elif line[:5] == b"data:":
                value = line[6:] if line[5:6] == b" " else line[5:]
                pending = value if pending is None else pending + b"\n" + value
        self._data = pending

    def _event(self, data: bytes) -> None:
        try:
            chunk = _loads(data)
        except ValueError:
            if data == b"[DONE]":
                self.done = True
                return
            chunk = _loads_like_json(data)
        self._chunk(chunk)

    def _chunk(self, chunk: Any) -> None:
        """A whole chunk: checked, its envelope read when it may carry one, then its choice."""
        if type(chunk) is not dict:
            raise MalformedResponseError(f"stream chunk is a JSON {type(chunk).__name__}, expected an object")
        if not self.meta or "error" in chunk or "usage" in chunk:
            self._envelope(chunk)
        self._choice(chunk.get("choices"), chunk)

    def _choice(self, choices: Any, chunk: dict[str, Any]) -> None:
        """The first choice's delta into the text buffers, and its finish_reason."""
        if not choices:
            return
        try:
            choice = choices[0]
            delta = choice.get("delta")
            if delta:
                piece = delta.get("reasoning")
                if piece:
                    reasoning = self._reasoning
                    if reasoning is None:
                        reasoning = self._reasoning = bytearray()
                    try:
                        reasoning += piece.encode()
                    except UnicodeEncodeError:  # a UTF-16 half, joined with its other half in `_text`
                        reasoning += piece.encode("utf-8", "surrogatepass")
                else:
                    self._reasoning_content(delta, piece)
                piece = delta.get("content")
                if piece:
                    self._content += _utf8(piece)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self._envelope(chunk)
        except (AttributeError, KeyError, IndexError, TypeError) as exc:
            raise MalformedResponseError(f"stream chunk of an unexpected shape: {str(chunk)[:200]}") from exc
        if self.on_choice is not None:
            self.on_choice(choice)

    def _reasoning_content(self, delta: dict[str, Any], piece: Any) -> None:
        """A delta whose `reasoning` is missing, null or "": `reasoning_content` (vLLM's, SGLang's name) counts
        then; "" must not hide it. An empty reasoning still makes the field present."""
        if piece is None or (piece == "" and delta.get("reasoning_content")):
            piece = delta.get("reasoning_content")
        if piece:
            if self._reasoning is None:
                self._reasoning = bytearray()
            self._reasoning += _utf8(piece)
        elif piece == "" and self._reasoning is None:
            self._reasoning = bytearray()

    def _envelope(self, chunk: dict[str, Any]) -> None:
        """What a chunk carries beside its delta: the id and provider (first seen wins), usage, an error. Read
        from the first chunk and from any chunk with an error, usage or a finish_reason."""
        if chunk.get("error"):
            self.error = chunk["error"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        meta = self.meta
        for key in ENVELOPE_KEYS:
            if key not in meta and chunk.get(key) is not None:
                meta[key] = chunk[key]
                if key == "id" and self.on_generation_id is not None and isinstance(meta["id"], str):
                    self.on_generation_id(meta["id"])

    def generation_id(self) -> str | None:
        """The id from the chunks seen so far: what a cut stream's billing can be looked up by."""
        gen_id = self.meta.get("id")
        return gen_id if isinstance(gen_id, str) else None

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": _text(self._content)}
        if self._reasoning is not None:
            message["reasoning"] = _text(self._reasoning)
        body: dict[str, Any] = {
            **self.meta,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
        }
        if self.usage is not None:
            body["usage"] = self.usage
        return body


def _utf8(piece: str) -> bytes:
    """A text piece for a field's buffer; a UTF-16 half (half a character, the rest in the next chunk) is kept as
    its own code, to be joined in `_text`."""
    try:
        return piece.encode()
    except UnicodeEncodeError:
        return piece.encode("utf-8", "surrogatepass")


def _loads_like_json(data: bytes) -> Any:
    """What `json.loads` makes of what orjson refused: a lone UTF-16 half, NaN, integers beyond 64 bits; invalid
    UTF-8 is replaced, as the non-streaming path does with the whole body."""
    try:
        return json.loads(data.decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise MalformedResponseError(f"stream chunk is not JSON: {data[:200]!r}") from exc


def _text(buffer: bytearray) -> str:
    """A field's UTF-8 buffer as text; UTF-16 halves that arrived in separate chunks become one character."""
    text = buffer.decode("utf-8", "surrogatepass")
    if b"\xed" in buffer and _SURROGATE.search(text):
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return text
