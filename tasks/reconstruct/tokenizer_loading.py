"""Tokenizers come from a local model directory only (never a hub); the revision recorded in provenance is a
hash of the tokenizer files, so two runs that disagree on ids can be told apart by their metadata.

Two kinds of directory are loaded the same way (`AutoTokenizer`, `local_files_only`): a `tokenizer.json`
(fast, Rust) tokenizer, and a tiktoken-based one whose Python class sits next to its `tiktoken.model` and is
named by `auto_map` in `tokenizer_config.json` (Kimi-K2/K2.5; needs `trust_remote_code`). That class file is
code that decides every id, so it is part of the hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tasks.common.config import TokenizerConfig
from tasks.common.errors import ConfigError
from tasks.common.messages import Message

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tiktoken.model",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
)


def remote_code_files(path: Path) -> list[str]:
    """The Python files `auto_map` in tokenizer_config.json points at (`module.Class` -> `module.py`)."""
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return []
    auto_map = json.loads(config.read_text()).get("auto_map") or {}
    refs: list[str] = []
    for value in auto_map.values():
        refs += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    modules = {ref.split("--")[-1].rsplit(".", 1)[0] + ".py" for ref in refs}
    return sorted(m for m in modules if (path / m).is_file())


@lru_cache(maxsize=256)
def _file_hash(path: Path, mtime_ns: int, size: int) -> str:
    """Keyed by modification time and size too, so an edited file is hashed again (every part asks)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def tokenizer_file_hashes(path: Path) -> dict[str, str]:
    """sha256 (16 hex) of every file that decides ids: vocabularies, configs, templates, tokenizer code."""
    names = [n for n in TOKENIZER_FILES if (path / n).is_file()] + remote_code_files(path)
    out = {}
    for name in names:
        stat = (path / name).stat()
        out[name] = _file_hash((path / name).resolve(), stat.st_mtime_ns, stat.st_size)
    return out


def tokenizer_hash(path: Path) -> str:
    return _digest(tokenizer_file_hashes(path))


def _digest(file_hashes: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name, file_hash in file_hashes.items():
        digest.update(name.encode())
        digest.update(file_hash.encode())
    return digest.hexdigest()[:16]


def detected_revision(path: Path) -> str | None:
    """The commit of a Hugging Face cache snapshot (`.../snapshots/<commit>`), the usual local layout."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and len(resolved.name) == 40:
        return resolved.name
    return None


@lru_cache(maxsize=4)
def _load(path: str, trust_remote_code: bool, files_hash: str) -> PreTrainedTokenizerBase:
    """Cached per directory *content* (`files_hash`): a directory whose files changed is loaded again."""
    try:
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as exc:
        hint = ""
        if remote_code_files(Path(path)) and not trust_remote_code:
            hint = " (its tokenizer class is Python code named by auto_map: set tokenizer.trust_remote_code: true)"
        raise ConfigError(f"cannot load the tokenizer in {path}{hint}: {type(exc).__name__}: {exc}") from exc
    return tok


def load_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerBase:
    if not cfg.path.is_dir():
        raise ConfigError(f"tokenizer.path {cfg.path} is not a local directory")
    files = tokenizer_file_hashes(cfg.path)
    if not files:  # transformers would blame a missing sentencepiece or tiktoken install instead
        raise ConfigError(
            f"tokenizer.path {cfg.path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES[:6])}, ...): "
            "point it at the target model's directory"
        )
    return _load(str(cfg.path), cfg.trust_remote_code, _digest(files))


def tokenizer_provenance(cfg: TokenizerConfig) -> dict[str, Any]:
    return {
        "tokenizer_revision": cfg.revision or detected_revision(cfg.path),
        "tokenizer_hash": tokenizer_hash(cfg.path),
        "tokenizer_files": tokenizer_file_hashes(cfg.path),
        "tokenizer_trust_remote_code": cfg.trust_remote_code,
        "chat_template_kwargs": dict(cfg.chat_template_kwargs),
    }


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Role and content, plus the reasoning of the target's own earlier answers (every_turn history) under every
    key a template may read it from, so a template that shows earlier reasoning renders what the server saw."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    if message["role"] == "assistant":
        reasoning = next((message.get(k) for k in REASONING_KEYS if message.get(k)), None)
        if reasoning:
            out.update({key: reasoning for key in REASONING_KEYS})
    return out


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """The prompt exactly as the server renders it before generating: chat template + generation prompt.

    `template_kwargs` are the chat-template variables the server is run with (`thinking`, `enable_thinking`,
    `reasoning_effort`): they change the generation prompt, so they must be the same here and there.
    """
    text = tokenizer.apply_chat_template(
        [template_message(m) for m in messages],
        tokenize=False,
        add_generation_prompt=True,
        **dict(template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    ids: list[int] = tokenizer.encode(render_prompt(tokenizer, messages, template_kwargs), add_special_tokens=False)
    return ids


def added_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Every added (control) token id -> its string: what must never appear inside generated text."""
    return {idx: tok.content for idx, tok in tokenizer.added_tokens_decoder.items()}


def tokenizer_from_tiktoken(
    bpe_file: Path, special_tokens: Mapping[str, int], pattern: str, nfc: bool = True, fill_gaps: bool = False
) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a tiktoken BPE rank file and a special-token table (Qwen, Kimi ship this form).

    Special-token ids are those of the table, never of insertion order: the table must continue the BPE ranks
    without gaps, and every string is checked to land on its own id, so a table typo fails here instead of
    shifting ids in the data. `fill_gaps` is for tables that really have holes (gpt-oss and Kimi reserve ranges
    of ids): each hole gets a `<|reserved_token_N|>` filler token so that the listed strings keep their ids.
    """
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not bpe_file.is_file():
        raise ConfigError(f"tiktoken BPE file {bpe_file} does not exist")
    if not special_tokens:
        raise ConfigError("a tiktoken tokenizer needs its special-token table (end of turn lives there)")
    table = dict(special_tokens)
    backend = TikTokenConverter(vocab_file=str(bpe_file), pattern=pattern).converted()
    if nfc:
        backend.normalizer = normalizers.NFC()
    base = backend.get_vocab_size()
    if fill_gaps:
        taken = set(table.values())
        if min(taken) < base:
            raise ConfigError(f"special-token ids must not overlap the {base} BPE ranks; got {min(taken)}")
        table.update({f"<|reserved_token_{i}|>": i for i in range(base, max(taken)) if i not in taken})
    ordered = sorted(table.items(), key=lambda item: item[1])
    ids = [i for _, i in ordered]
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ConfigError(f"special-token ids must be contiguous, without gaps; got {ids}")
    if ids[0] != base:
        raise ConfigError(f"special-token ids must start right after the {base} BPE ranks")
    backend.add_special_tokens([AddedToken(s, normalized=False, special=True) for s, _ in ordered])
    wrong = {s: backend.token_to_id(s) for s, i in special_tokens.items() if backend.token_to_id(s) != i}
    if wrong:
        raise ConfigError(f"special tokens landed on the wrong ids: {wrong}")
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
