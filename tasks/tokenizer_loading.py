"""Tokenizers come from a local model directory only (never a hub); the revision recorded in provenance is a
hash of the tokenizer files, so two runs that disagree on ids can be told apart by their metadata."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tasks.config import TokenizerConfig
from tasks.errors import ConfigError
from tasks.messages import Message

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tiktoken.model",
    "special_tokens_map.json",
)


def tokenizer_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            digest.update(name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=4)
def _load(path: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer.path {path} is not a local directory")
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, local_files_only=True
    )
    return tok


def load_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerBase:
    return _load(str(cfg.path), cfg.trust_remote_code)


def tokenizer_provenance(cfg: TokenizerConfig) -> dict[str, Any]:
    return {"tokenizer_revision": cfg.revision, "tokenizer_hash": tokenizer_hash(cfg.path)}


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> str:
    """The prompt exactly as the server renders it before generating: chat template + generation prompt."""
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    ids: list[int] = tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False)
    return ids


def backend_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a fast tokenizer: batch encoding without per-row Python.

    Reconstruction needs offsets and batch throughput that only the backend gives; a slow (Python) tokenizer
    is refused rather than silently used.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ConfigError(f"{type(tokenizer).__name__} has no fast (Rust) backend; reconstruction needs one")
    return backend


def added_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Every added (control) token id -> its string: what must never appear inside generated text."""
    return {idx: tok.content for idx, tok in tokenizer.added_tokens_decoder.items()}


def tokenizer_from_tiktoken(
    bpe_file: Path, special_tokens: Mapping[str, int], pattern: str, nfc: bool = True
) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a tiktoken BPE rank file and a special-token table (Qwen, Kimi ship this form).

    Special-token ids are those of the table, never of insertion order: the table must continue the BPE ranks
    without gaps, and every string is checked to land on its own id, so a table typo fails here instead of
    shifting ids in the data.
    """
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not bpe_file.is_file():
        raise ConfigError(f"tiktoken BPE file {bpe_file} does not exist")
    if not special_tokens:
        raise ConfigError("a tiktoken tokenizer needs its special-token table (end of turn lives there)")
    ordered = sorted(special_tokens.items(), key=lambda item: item[1])
    ids = [i for _, i in ordered]
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ConfigError(f"special-token ids must be contiguous, without gaps; got {ids}")
    backend = TikTokenConverter(vocab_file=str(bpe_file), pattern=pattern).converted()
    if nfc:
        backend.normalizer = normalizers.NFC()
    if ids[0] != backend.get_vocab_size():
        raise ConfigError(f"special-token ids must start right after the {backend.get_vocab_size()} BPE ranks")
    backend.add_special_tokens([AddedToken(s, normalized=False, special=True) for s, _ in ordered])
    wrong = {s: backend.token_to_id(s) for s, i in ordered if backend.token_to_id(s) != i}
    if wrong:
        raise ConfigError(f"special tokens landed on the wrong ids: {wrong}")
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
