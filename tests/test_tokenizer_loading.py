"""Loading tokenizers from local model directories, including a Kimi-style tiktoken tokenizer class behind
`trust_remote_code`, and reconstructing/validating real parts with it (no Rust backend)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizerBase

from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig
from tasks.common.errors import ConfigError, ReconstructionError
from tasks.common.messages import prompt_messages
from tasks.common.shards import PartRef, read_part, read_provenance
from tasks.reconstruct.completion_format import PRESETS, completion_layout
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.tokenizer_backend import (
    PROBES,
    RustBackend,
    SlowTokenizerBackend,
    TiktokenBackend,
    backend_for,
)
from tasks.reconstruct.tokenizer_loading import (
    detected_revision,
    load_tokenizer,
    render_prompt,
    tokenizer_file_hashes,
    tokenizer_from_tiktoken,
    tokenizer_hash,
    tokenizer_provenance,
)
from tasks.validate.checks import validate_part
from tests.fixtures import families as F
from tests.test_reconstruct import CONVERSATIONS, response_row, sid_of, write_inputs

KIMI = PRESETS["kimi_k2_thinking"]
ANSWERS = [
    ("The user asks about NOR gates.", "A NOR gate outputs 1 only when all inputs are 0."),
    ("Pick one that is not 7.\nEleven works.", "eleven"),
    ("简单的问候；👋 保留。", "Salut 👋 !"),
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return F.kimi_like_dir(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def kimi(kimi_dir: Path) -> PreTrainedTokenizerBase:
    return F.load(kimi_dir, trust_remote_code=True)


def kimi_cfg(run_dir: Path, tok_dir: Path) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="demo", path=run_dir / "in.jsonl")],
        endpoint=EndpointConfig(model="kimi-like"),
        tokenizer=TokenizerConfig(path=tok_dir, trust_remote_code=True, completion_format="kimi_k2_thinking"),
    )


def test_kimi_style_directory_loads_its_python_class_locally(kimi_dir: Path, kimi: PreTrainedTokenizerBase) -> None:
    assert type(kimi).__name__ == "KimiLikeTikTokenTokenizer"
    assert getattr(kimi, "backend_tokenizer", None) is None  # a slow tokenizer: no Rust backend
    assert kimi.encode("<|im_end|>", add_special_tokens=False) == [163586]
    with pytest.raises(ConfigError, match="trust_remote_code: true"):
        load_tokenizer(TokenizerConfig(path=kimi_dir, trust_remote_code=False))


def test_tiktoken_shortcut_gives_the_tokenizers_own_ids(kimi: PreTrainedTokenizerBase) -> None:
    backend = backend_for(kimi)
    assert isinstance(backend, TiktokenBackend)
    slow = SlowTokenizerBackend(kimi, "reference")
    texts = [*PROBES, completion_layout(KIMI, "a<b> 你好", "c\n\nd").text]
    assert backend.encode_batch(texts) == slow.encode_batch(texts)
    bounds = [[0, 3, len(t) // 2, len(t) - 1, len(t)] for t in texts]
    fast_ids, fast_at = backend.encode_with_boundaries(texts, bounds)
    slow_ids, slow_at = slow.encode_with_boundaries(texts, bounds)
    assert fast_ids == slow_ids and np.array_equal(fast_at, slow_at)
    assert backend.decode_batch(fast_ids) == texts


def test_slow_and_rust_backends_place_boundaries_alike(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(TokenizerConfig(path=tokenizer_dir))
    rust = backend_for(tok)
    assert isinstance(rust, RustBackend)
    slow = SlowTokenizerBackend(tok, "reference")
    texts = [completion_layout(PRESETS["deepseek_v31_thinking"], r, c).text for r, c in ANSWERS]
    bounds = [[completion_layout(PRESETS["deepseek_v31_thinking"], r, c).content_start, 5] for r, c in ANSWERS]
    r_ids, r_at = rust.encode_with_boundaries(texts, bounds)
    s_ids, s_at = slow.encode_with_boundaries(texts, bounds)
    assert r_ids == s_ids and np.array_equal(r_at, s_at)


def test_a_shortcut_that_disagrees_is_caught_naming_the_sample(kimi: PreTrainedTokenizerBase) -> None:
    """Same BPE ranks, but an encoding that lacks Kimi's <think> control tokens: other ids."""
    qwen_split = tiktoken.Encoding(
        name="no-think-tokens",
        pat_str=F.QWEN_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(F.QWEN_TIKTOKEN)),
        special_tokens={"<|im_end|>": 163586},
    )
    wrong = TiktokenBackend(kimi, qwen_split)
    text = "Hello <think>你好</think>"
    with pytest.raises(ReconstructionError, match="sample s-1: tiktoken backend ids differ"):
        wrong.spot_check([text], ["s-1"], wrong.encode_batch([text]))


def test_reconstruct_and_validate_with_a_slow_tokenizer(
    tmp_path: Path, kimi_dir: Path, kimi: PreTrainedTokenizerBase
) -> None:
    cfg = kimi_cfg(tmp_path, kimi_dir)
    responses = [response_row(sid_of(c), r, a) for c, (r, a) in zip(CONVERSATIONS, ANSWERS, strict=True)]
    completion = kimi.encode(f"<think>{ANSWERS[0][0]}</think>{ANSWERS[0][1]}<|im_end|>", add_special_tokens=False)
    responses[0]["output_ids"] = completion
    write_inputs(tmp_path, 0, CONVERSATIONS, responses)
    stats = reconstruct_part(cfg, 0, KIMI)
    assert stats["rows"] == 3
    rows = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()
    for row, conv, (reasoning, content) in zip(rows, CONVERSATIONS, ANSWERS, strict=True):
        prompt = render_prompt(kimi, prompt_messages(conv))
        assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
        ids, p, r = row["input_ids"], row["prompt_len"], row["reasoning_len"]
        assert kimi.decode(ids, skip_special_tokens=False) == f"{prompt}<think>{reasoning}</think>{content}<|im_end|>"
        assert ids[: p + 1][-1] == 163606 and ids[p + r - 1] == 163607 and ids[-1] == 163586
        assert kimi.decode(ids[p + r : -1], skip_special_tokens=False) == content
    provenance = read_provenance(PartRef(tmp_path, "tokens", 0).path)
    assert provenance["tokenizer_backend"] == "tiktoken"
    assert provenance["tokenizer_class"] == "KimiLikeTikTokenTokenizer"
    assert set(provenance["tokenizer_files"]) >= {"tiktoken.model", "tokenization_kimi_like.py", "chat_template.jinja"}
    assert provenance["completion_format_check"]["reasoning_visible"] is True

    validate_part(cfg, 0, KIMI)
    checked = {r["sample_id"]: r for r in read_part(PartRef(tmp_path, "validation", 0)).to_pylist()}
    first = checked[sid_of(CONVERSATIONS[0])]
    assert first["reference_match"] == "exact" and first["verdict"] == "pass"
    assert all(r["structural_issues"] == [] for r in checked.values())


def test_hash_covers_the_tokenizer_code_and_snapshots_carry_their_revision(tmp_path: Path, kimi_dir: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--moonshotai--Kimi-K2" / "snapshots" / commit
    shutil.copytree(kimi_dir, snapshot)
    before = tokenizer_hash(snapshot)
    assert before == tokenizer_hash(kimi_dir)
    assert detected_revision(snapshot) == commit and detected_revision(kimi_dir) is None
    provenance = tokenizer_provenance(TokenizerConfig(path=snapshot, trust_remote_code=True))
    assert provenance["tokenizer_revision"] == commit
    code = snapshot / "tokenization_kimi_like.py"
    code.write_text(code.read_text() + "\n# a changed tokenizer class changes the ids it may produce\n")
    assert tokenizer_hash(snapshot) != before
    assert (
        tokenizer_file_hashes(snapshot)["tokenization_kimi_like.py"]
        != tokenizer_file_hashes(kimi_dir)["tokenization_kimi_like.py"]
    )


def test_tiktoken_table_with_reserved_holes_keeps_every_id() -> None:
    tok = tokenizer_from_tiktoken(
        F.QWEN_TIKTOKEN, {"<|im_end|>": 151645, "<|x|>": 151650}, F.QWEN_PATTERN, fill_gaps=True
    )
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|x|>"]) == [151645, 151650]
    assert tok.convert_ids_to_tokens(151643) == "<|reserved_token_151643|>"
    with pytest.raises(ConfigError, match="overlap"):
        tokenizer_from_tiktoken(F.QWEN_TIKTOKEN, {"<|x|>": 10}, F.QWEN_PATTERN, fill_gaps=True)


def test_provenance_records_the_template_kwargs(tmp_path: Path) -> None:
    path = F.deepseek_dir(tmp_path / "ds")
    provenance = tokenizer_provenance(TokenizerConfig(path=path, chat_template_kwargs={"thinking": True}))
    assert provenance["chat_template_kwargs"] == {"thinking": True}
    assert json.loads(json.dumps(provenance))["tokenizer_hash"] == tokenizer_hash(path)


def test_a_directory_without_tokenizer_files_is_named_as_such(tmp_path: Path) -> None:
    """transformers' own error for it asks to install sentencepiece or tiktoken, which is not the problem."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no tokenizer files"):
        load_tokenizer(TokenizerConfig(path=tmp_path))
