"""A streamed chat completion (Server-Sent Events), folded as its bytes arrive into the body a non-streamed call
returns, so streamed and non-streamed answers go through the same parsing and give the same row.

Built for 10,000 long streams at once on two cores (`bench/stream_throughput.py`): `feed` takes whatever the
socket gave and keeps only the unfinished end; each event is read once and dropped; each text field is one buffer
that grows in place, holding the text as the JSON string body it arrived as, decoded once in `body()` (so a
character whose UTF-16 halves came in two chunks, from a server that cuts strings by code units, comes out whole,
as in the non-streamed answer). Nothing per event outlives its `feed`, and no piece is its own object.

Reading an event, cheapest first:
- a stream repeats its envelope (id, provider, model, created) in every chunk, and most chunks have one of a few
  shapes that differ only in their text. Both are learned from chunks that were fully parsed, and checked against
  them: the envelope as a byte prefix, a shape as a pattern that is the chunk's exact bytes but for its text values,
  each matching only a JSON string body. A chunk that starts with the envelope and matches a shape in full is
  exactly that shape with other text; its text body is appended as it is;
- otherwise the chunk is parsed with orjson (after the envelope when it starts with it), and with `json` when orjson
  refuses it (NaN, half of a UTF-16 pair); orjson's values are `json.loads`'s but for integers beyond 64 bits, which
  it makes floats.

Wire format (the SSE spec, as OpenAI and OpenRouter use it): lines end with LF, CRLF or CR; the `data:` lines of
one event are joined with LF, and the event is handled at the blank line that ends it (or at the end of the body);
comment lines (OpenRouter's `: OPENROUTER PROCESSING`) and other fields are skipped; `data: [DONE]` ends the
stream. Usage may come in the finish chunk or in a last chunk with no choices; a mid-stream failure is a chunk
with an `error` object; a stream that ends without a finish_reason is truncated, whatever else arrived.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from orjson import dumps as _dumps
from orjson import loads as _loads

from tasks.generate.endpoints import MalformedResponseError
from tasks.generate.token_bytes import LogprobTokens

ENVELOPE_KEYS = ("id", "provider", "model", "quantization", "prompt_token_ids")
LEARN_TRIES = 4
SHAPE_TRIES = 8
MAX_SHAPES = 3
# The learned envelope ends with the choices key; what follows is parsed as an object of its own.
CHOICES_KEY = b',"choices":'
REST_START = b'{"choices":'
# A JSON string token, and the body of one that is valid JSON (escapes checked, no raw control characters).
_STRING_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BODY = rb'(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+'


class StreamAssembler:
    """One stream's state. Hooks: `on_generation_id(id)` is called once, as soon as the generation id is known
    (the first chunk carries it), so the spend ledger records it before the answer ends; `on_choice(choice)` with
    each chunk's first choice, parsed, the place for other per-chunk fields (with it, every chunk is parsed:
    shapes are not learned). Per-token `logprobs` are accumulated in `logprobs` (`endpoint.logprobs`) and given
    back in `body()` as one non-streamed `logprobs` object, and vLLM's per-chunk `token_ids`
    (`endpoint.return_token_ids`) as the choice's `token_ids`, its first chunk's `prompt_token_ids` beside them; a
    chunk that carries either is always parsed."""

    __slots__ = (
        "_by_line",
        "_content",
        "_data",
        "_has_reasoning",
        "_learn_left",
        "_open",
        "_prefix",
        "_reasoning",
        "_shape_tries",
        "_shapes",
        "_tail",
        "done",
        "error",
        "finish_reason",
        "logprobs",
        "meta",
        "on_choice",
        "on_generation_id",
        "token_ids",
        "usage",
    )

    def __init__(
        self,
        on_generation_id: Callable[[str], None] | None = None,
        on_choice: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.on_generation_id = on_generation_id
        self.on_choice = on_choice
        self._reasoning = bytearray()  # JSON string bodies, as they arrived
        self._has_reasoning = False  # a reasoning field arrived, if only "": then "" is the answer's reasoning
        self._content = bytearray()
        self._tail = b""
        self._by_line = False
        self._open: bytes | None = None
        self._data: bytes | None = None
        self._prefix = b""
        self._learn_left = LEARN_TRIES
        self._shapes: list[tuple[re.Pattern[bytes], bool]] = []
        self._shape_tries = SHAPE_TRIES
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        self.error: Any = None
        self.done = False
        self.logprobs = LogprobTokens()
        self.token_ids: list[Any] | None = None

    def feed(self, data: bytes) -> None:
        """The next bytes of the body, cut anywhere.

        With LF line ends (OpenAI's, OpenRouter's) the bytes are split at LF, lines gather into an event until its
        blank line, and an event that is one `data:` line (all of them, in practice) is read straight from that
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
        shapes = self._shapes
        for line in lines:
            if line:
                event = line if event is None else event + b"\n" + line
                continue
            if event is None:
                continue
            this, event = event, None
            # A ValueError: [DONE], several lines, or what orjson refuses; `_event_lines` sorts them out.
            if cut and this.startswith(prefix):
                for shape, with_reasoning in shapes:
                    found = shape.fullmatch(this, cut)
                    if found is not None:
                        reasoning, content = found.groups()
                        if reasoning or not with_reasoning:  # an empty reasoning follows the general rules
                            if reasoning:
                                self._reasoning += reasoning
                            if content:
                                self._content += content
                            break
                else:
                    found = None
                if found is not None:
                    continue
                try:
                    chunk = _loads(REST_START + this[cut:])
                except ValueError:
                    self._event_lines(this)
                    continue
                if len(chunk) == 1:  # only "choices": the envelope is the learned one, nothing else rides along
                    choices = chunk["choices"]
                    self._choice(choices, chunk)
                    if self._shape_tries and self.on_choice is None:
                        self._learn_shape(this, cut, choices)
                        shapes = self._shapes
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
            elif this[:1] == b":" and b"\n" not in this:
                continue  # a comment, such as OpenRouter's keep-alive
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
        """Learn the stream's envelope: the bytes before `"choices"`, which every chunk of a stream repeats. A later
        event that starts with exactly these bytes is read from there on, its envelope the one already read. Kept
        only when the two parts parse to exactly the whole chunk; tried again on a chunk that does not match, a few
        times."""
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

    def _learn_shape(self, event: bytes, cut: int, choices: Any) -> None:
        """Learn the shape of a chunk (after its envelope) whose only choice carries reasoning text or content
        text and no finish_reason: its exact bytes with each string value equal to that text replaced by a JSON
        string body pattern, capturing the one under the text's own key. Kept only when it matches the chunk it
        was learned from and gives back its text."""
        self._shape_tries -= 1
        if len(self._shapes) >= MAX_SHAPES or type(choices) is not list or len(choices) != 1:
            return
        choice = choices[0]
        delta = choice.get("delta") if type(choice) is dict else None
        if (
            type(delta) is not dict
            or choice.get("finish_reason") is not None
            or choice.get("logprobs") is not None  # per-token data a shape would skip: such chunks are parsed
            or choice.get("token_ids") is not None
            or delta.get("reasoning_content")
        ):
            return
        reasoning, content = delta.get("reasoning"), delta.get("content")
        if type(reasoning) is str and reasoning and not content:
            key, text = b'"reasoning"', reasoning
        elif type(content) is str and content and not reasoning:
            key, text = b'"content"', content
        else:
            return
        rest = event[cut:]
        parts: list[bytes] = [] if key == b'"reasoning"' else [b"()"]
        captured, at, last_key = 0, 0, b""
        for token in _STRING_TOKEN.finditer(rest):
            start, end = token.span()
            follows = rest[end : end + 1]
            if follows == b":":
                last_key = token.group()
                continue
            if follows not in (b",", b"}", b"]") or json.loads(token.group()) != text:
                continue  # a literal (or spacing the shape would not match anyway)
            parts += [re.escape(rest[at:start]), b'"(' + _BODY + b')"' if last_key == key else b'"' + _BODY + b'"']
            captured += last_key == key
            at = end
        if captured != 1:
            return
        parts += [re.escape(rest[at:]), b"()" if key == b'"reasoning"' else b""]
        shape = re.compile(b"".join(parts))
        found = shape.fullmatch(event, cut)
        if found is None or json.loads(b'"' + found.group(1 if key == b'"reasoning"' else 2) + b'"') != text:
            return
        self._shapes.append((shape, key == b'"reasoning"'))

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
        """The first choice's delta into the text buffers, and its finish_reason. `reasoning` counts when it is
        text; when it is missing, null or "", `reasoning_content` (vLLM's, SGLang's name) does ("" must not hide
        it), and an empty reasoning still makes the field present."""
        if not choices:
            return
        try:
            choice = choices[0]
            delta = choice.get("delta")
            if delta:
                piece = delta.get("reasoning")
                if piece is None or (piece == "" and delta.get("reasoning_content")):
                    piece = delta.get("reasoning_content")
                if piece is not None:
                    self._has_reasoning = True
                    if piece:
                        self._reasoning += _body(piece)
                piece = delta.get("content")
                if piece:
                    self._content += _body(piece)
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                self.logprobs.feed(logprobs)
            ids = choice.get("token_ids")
            if ids is not None:
                if type(ids) is not list:
                    raise TypeError("token_ids")
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)  # a 32k-token answer streams 32k chunks: no copy per chunk
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self._envelope(chunk)
        except (AttributeError, KeyError, IndexError, TypeError) as exc:
            raise MalformedResponseError(f"stream chunk of an unexpected shape: {str(chunk)[:200]}") from exc
        if self.on_choice is not None:
            self.on_choice(choice)

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
        if self._has_reasoning:
            message["reasoning"] = _text(self._reasoning)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": self.finish_reason}
        if self.logprobs.seen:
            choice["logprobs"] = self.logprobs.wire()
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        body: dict[str, Any] = {**self.meta, "choices": [choice]}
        if self.usage is not None:
            body["usage"] = self.usage
        return body


def _body(piece: Any) -> bytes:
    """A parsed text piece as a JSON string body, as the fast path keeps the ones it does not parse."""
    if type(piece) is not str:
        raise TypeError(f"text piece is a {type(piece).__name__}")
    try:
        return _dumps(piece)[1:-1]
    except TypeError:  # a UTF-16 half, which orjson refuses: escaped, it joins its other half in `_text`
        return json.dumps(piece)[1:-1].encode()


def _loads_like_json(data: bytes) -> Any:
    """What `json.loads` makes of what orjson refused: a lone UTF-16 half, NaN, integers beyond 64 bits; invalid
    UTF-8 is replaced, as the non-streaming path does with the whole body."""
    try:
        return json.loads(data.decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise MalformedResponseError(f"stream chunk is not JSON: {data[:200]!r}") from exc


def _text(buffer: bytearray) -> str:
    """A field's JSON string bodies as text; invalid UTF-8 is replaced, as the non-streaming path does."""
    try:
        text = json.loads('"' + buffer.decode("utf-8", errors="replace") + '"')
    except ValueError as exc:
        raise MalformedResponseError(f"streamed text is not a JSON string: {exc}") from exc
    if not isinstance(text, str):
        raise MalformedResponseError("streamed text is not a JSON string")
    return text
