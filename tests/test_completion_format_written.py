"""A completion format written out in the config, for models whose chat template never shows their reasoning.

SmolLM3 (like MiMo-VL, Ministral-3-Reasoning and Granite-3.3) reasons with thinking on, but its template renders
assistant turns without the reasoning, so `auto` derives a format without it and every answer that reasons is
refused. The written format is checked against what the template does show (its end of turn, whether the
generation prompt opens the reasoning; every field where reasoning is rendered) and its control tokens must be
single ids, before anything is sent.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.exit_codes import ExitCode
from tasks.common.config import CompletionFormatSpec, ReconstructConfig, TokenizerConfig, load_config
from tasks.common.errors import ConfigError, SpecialTokenError
from tasks.generate.rerun_policy import settings_fingerprint
from tasks.reconstruct.completion_format import PRESETS, completion_text, format_for, resolve_format
from tasks.reconstruct.special_tokens import verify_special_tokens
from tasks.reconstruct.stage import SampleText, build_tokens_table
from tasks.reconstruct.tokenizer_loading import render_prompt
from tests.conftest import REPO, run_main
from tests.fixtures import families as F

SMOLLM3_THINKING: dict[str, Any] = {
    "name": "smollm3_thinking",
    "reasoning_open": "<think>",
    "reasoning_close": "</think>",
    "reasoning_pad": "\n",
    "content_separator": "\n",
    "end_of_turn": "<|im_end|>",
}


def spec(**changes: Any) -> CompletionFormatSpec:
    return CompletionFormatSpec.model_validate({**SMOLLM3_THINKING, **changes})


def test_smollm3_reasoning_is_rebuilt_from_the_written_format() -> None:
    """`auto` can only see a format without reasoning; the written one lays the answer out as the model writes
    it, which is the layout SmolLM3's own /no_think prompt shows with the think block empty."""
    tok = F.shared("smollm3")
    assert not resolve_format("auto", tok).has_reasoning
    fmt = resolve_format(spec(), tok)
    verify_special_tokens(tok, fmt)
    assert fmt.name == "smollm3_thinking" and fmt.control_tokens == ("<think>", "</think>", "<|im_end|>")
    assert completion_text(fmt, "2 and 2.", "It is 4.") == "<think>\n2 and 2.\n</think>\nIt is 4.<|im_end|>"
    user = [{"role": "user", "content": "2+2?"}]
    no_think = render_prompt(tok, user, {"enable_thinking": False})
    thinking = render_prompt(tok, user, {})
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    shown_empty = no_think[no_think.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :]
    assert completion_text(fmt, "", "It is 4.") == shown_empty + "It is 4.<|im_end|>"

    emitted = tok.encode("<think>\n2 and 2.\n</think>\nIt is 4.<|im_end|>", add_special_tokens=False)
    sample = SampleText("s0", "d", user, "\n2 and 2.\n", "\nIt is 4.", "stop", None)  # type: ignore[arg-type]
    table, _ = build_tokens_table(tok, fmt, [sample], ReconstructConfig(), {})
    row = table.to_pylist()[0]
    prompt_ids = tok.encode(thinking, add_special_tokens=False)
    assert row["input_ids"] == prompt_ids + emitted
    assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(emitted)


@pytest.mark.parametrize(
    ("family", "changes", "note"),
    [
        ("smollm3", {"end_of_turn": "<|endoftext|>"}, "end_of_turn: config '<|endoftext|>' vs template '<|im_end|>'"),
        ("smollm3", {"open_in_prompt": True}, "open_in_prompt: config True vs template False"),
        ("smollm3", {"pinned_ids": {"<|im_end|>": 128012}}, "pinned_ids"),
        ("qwen3", {}, "content_separator: config '\\n' vs template '\\n\\n'"),
        ("kimi_k25", {"reasoning_pad": "", "content_separator": ""}, "open_in_prompt: config False vs template True"),
    ],
)
def test_a_written_format_the_template_contradicts_is_refused(
    family: str, changes: dict[str, Any], note: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen3's template shows its reasoning, so every field is compared (it writes two newlines before the
    content); K2.5's prompt already opens the reasoning; SmolLM3's shows only its end of turn and a
    prompt that does not open the reasoning. A wrong pin is refused whatever the template shows."""
    tok = F.shared(family)
    written = spec(**changes)
    with pytest.raises(ConfigError, match="written in the config as 'smollm3_thinking'") as refused:
        resolve_format(written, tok)
    assert note in str(refused.value)
    with caplog.at_level(logging.WARNING):
        assert resolve_format(written, tok, on_disagreement="warn").name == "smollm3_thinking"
    assert "format_disagreement=warn" in caplog.text


def test_a_written_format_equal_to_a_preset_is_accepted_where_the_preset_is() -> None:
    qwen3 = PRESETS["qwen3_thinking"]
    written = spec(name="my_qwen3", content_separator="\n\n", pinned_ids=dict(qwen3.pinned_ids))
    fmt = resolve_format(written, F.shared("qwen3"))
    assert completion_text(fmt, "r", "c") == completion_text(qwen3, "r", "c")
    assert fmt.special_tokens() == qwen3.special_tokens()


def test_a_literal_that_is_not_one_id_is_refused_before_anything_is_sent() -> None:
    """`<reasoning>` looks like a control token but the tokenizer splits it: every answer would be corrupted."""
    tok = F.shared("smollm3")
    fmt = resolve_format(spec(reasoning_open="<reasoning>", reasoning_close="</reasoning>"), tok)
    with pytest.raises(SpecialTokenError, match="<reasoning>"):
        verify_special_tokens(tok, fmt)


def test_config_loads_the_written_format_and_refuses_a_broken_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = yaml.safe_load((REPO / "configs" / "run.yaml").read_text())
    raw["tokenizer"]["path"] = str(F.shared_dir("smollm3"))
    raw["tokenizer"]["completion_format"] = SMOLLM3_THINKING
    raw["run_dir"] = str(tmp_path / "run")
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    raw["datasets"] = [{"name": "d", "path": str(tmp_path / "data.jsonl")}]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    assert cfg.tokenizer.completion_format == spec() and cfg.tokenizer.completion_format_name == "smollm3_thinking"
    assert format_for(cfg, F.shared("smollm3")).reasoning_open == "<think>"
    auto = load_config(config, {"tokenizer.completion_format": "auto"})
    assert settings_fingerprint(cfg) != settings_fingerprint(auto)
    assert settings_fingerprint(cfg) == settings_fingerprint(load_config(config))

    for broken, message in [
        ({"name": "qwen3_thinking"}, "that name is taken"),
        ({"reasoning_close": None}, "reasoning_open and reasoning_close go together"),
        ({"end_of_turn": ""}, "end_of_turn"),
        ({"think_tag": "<think>"}, "think_tag"),
    ]:
        bad = {**SMOLLM3_THINKING, **broken}
        with pytest.raises(ValueError, match=message):
            TokenizerConfig(path=tmp_path, completion_format=bad)  # type: ignore[arg-type]
        raw["tokenizer"]["completion_format"] = bad
        config.write_text(yaml.safe_dump(raw))
        result = run_main(capsys, "estimate", str(config))
        assert result.returncode == ExitCode.USER, result.stderr
        assert len(result.stderr.splitlines()) == 1 and "completion_format" in result.stderr, result.stderr


def test_a_written_format_says_whether_an_answer_without_reasoning_omits_the_block() -> None:
    """Bielik-11B-v3 with thinking off renders an answer without reasoning as its content alone: a written format
    must say so (`omit_empty_reasoning`), or it is refused for the empty block it would invent. With the open tag
    in the generation prompt there is no block to leave out."""
    tok = F.shared("bielik_11b_v3")
    written = {**SMOLLM3_THINKING, "name": "bielik"}
    with pytest.raises(ConfigError, match="omit_empty_reasoning: config False vs template True"):
        resolve_format(CompletionFormatSpec.model_validate(written), tok)
    fmt = resolve_format(CompletionFormatSpec.model_validate({**written, "omit_empty_reasoning": True}), tok)
    assert completion_text(fmt, None, "It is 4.") == "It is 4.<|im_end|>"
    with pytest.raises(ValueError, match="omit_empty_reasoning with open_in_prompt"):
        spec(omit_empty_reasoning=True, open_in_prompt=True)
