"""The simulator backed by the target model (endpoint_sim.model_backend) and the report-section hook that the
evaluate stage writes into. No speculators needed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from endpoint_sim.model_backend import ModelResponder
from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.validate.sections import add_report_section, reapply_sections

MESSAGES = [{"role": "user", "content": "Explain binary search."}]


@pytest.fixture(scope="module")
def responder(tiny_model_dir: Path) -> ModelResponder:
    return ModelResponder(tiny_model_dir, SimConfig(reasoning_words=(5, 9), content_words=(4, 7)))


def test_answers_are_the_models_own_greedy_tokens(responder: ModelResponder) -> None:
    sample = responder.sample_for_messages(MESSAGES)
    out = list(sample.output_ids)
    close = out.index(responder.reasoning_close_id)
    assert sample.reasoning_tokens == close and 5 <= close <= 9 and 4 <= len(out) - close - 2 <= 7
    assert out[-1] == responder.eos_id
    prompt = list(sample.prompt_ids)
    with torch.inference_mode():
        logits = responder.model(input_ids=torch.tensor([prompt + out])).logits[0].float()
    for j, token in enumerate(out):
        if j == close or j == len(out) - 1:
            continue  # the two tokens the backend emits itself: `</think>` and the end of the turn
        allowed = logits[len(prompt) + j - 1].masked_fill(~responder.allowed, float("-inf"))
        assert token == int(allowed.argmax()), f"position {j}: {token} is not the model's greedy choice"
    assert sample.reasoning == responder.decode(out[:close]) and sample.content == responder.decode(out[close + 1 : -1])
    assert responder.sample_for_messages(MESSAGES) == sample  # deterministic per (prompt, seed)


@pytest.mark.slow  # decodes with the tiny model several times: make test-long
def test_sampling_is_seeded(tiny_model_dir: Path) -> None:
    sampled = ModelResponder(tiny_model_dir, SimConfig(reasoning_words=(6, 6), content_words=(6, 6)), temperature=1.0)
    first = sampled.sample_for_messages(MESSAGES, seed=1)
    assert sampled.sample_for_messages(MESSAGES, seed=1).output_ids == first.output_ids
    assert sampled.sample_for_messages(MESSAGES, seed=2).output_ids != first.output_ids


def test_generate_route_serves_the_models_output_ids(responder: ModelResponder, tiny_model_dir: Path) -> None:
    prompt = list(responder.prompt_ids_for_messages(MESSAGES))
    with SimulatorServer(tiny_model_dir, responder.config, responder=responder) as sim:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 64, "skip_special_tokens": False}}
        reply = httpx.post(f"{sim.base_url}/generate", json=body, timeout=60).json()
    expected = responder.sample(tuple(prompt), None)
    assert reply["output_ids"] == list(expected.output_ids)
    assert reply["text"] == expected.text


def test_report_sections_are_spliced_replaced_and_reapplied(tmp_path: Path) -> None:
    out = tmp_path / "reports"
    out.mkdir()
    (out / "report.md").write_text("# Validation report\n\nbody\n")
    (out / "report.html").write_text("<html><body><h1>r</h1></body></html>")
    add_report_section(tmp_path, "drafter-acceptance", "## Acceptance\n\n1.42", "<h2>Acceptance</h2><p>1.42</p>")
    add_report_section(tmp_path, "drafter-acceptance", "## Acceptance\n\n2.10", "<h2>Acceptance</h2><p>2.10</p>")
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert md.count("## Acceptance") == 1 and "2.10" in md and "1.42" not in md and md.startswith("# Validation")
    assert page.count("<h2>Acceptance</h2>") == 1 and page.endswith("</body></html>")
    (out / "report.md").write_text("# Validation report (re-rendered)\n")  # a later validate run
    reapply_sections(tmp_path)
    assert "2.10" in (out / "report.md").read_text()
    with pytest.raises(ValueError, match="section name"):
        add_report_section(tmp_path, "Bad Name", "x")


def test_train_cli_names_a_run_without_hidden_states_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.cli import main
    from flows.exit_codes import ExitCode

    assert main(["train", str(tmp_path), "--no-prefect"]) == ExitCode.USER
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no finished hidden_states parts" in err and str(tmp_path) in err
