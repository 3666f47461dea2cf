"""The train and evaluate stages end to end on CPU: speculators 0.9.0's own trainer (through the CPU shim) on a
real extracted run whose answers are the tiny target's own greedy continuations, then the acceptance walk.

Needs the `train` extra (speculators); skipped without it. One module-scoped training run (a few seconds of
CPU) backs every assertion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

pytest.importorskip("speculators", reason="the train extra (speculators==0.9.0) is not installed")

from tasks.common.schemas import TOKENS
from tasks.common.shards import PartRef, write_part
from tasks.evaluate import TOLERANCE, evaluate_run, evaluation_markdown
from tasks.evaluate.acceptance import Drafter, WalkStats
from tasks.extract.hf_backend import HFHiddenStateRunner
from tasks.extract.stage import extract_part
from tasks.train import TrainOptions, train_run
from tasks.train.stage import speculators_layer_ids
from tests.test_extract import make_cfg

pytestmark = pytest.mark.slow  # minutes of real pipeline and training runs: make test-long (CI runs both)

SAMPLES = 24
OPTIONS = TrainOptions(epochs=5, lr=3e-3, total_seq_len=128, draft_vocab_size=512, val_fraction=0.25)


def greedy_samples(model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask): a chat prompt, then the target's own greedy answer as the local endpoint's model
    backend produces it (reasoning, `</think>`, content, end of turn), exactly the demo's data."""
    from endpoint_sim.model_backend import ModelResponder
    from endpoint_sim.responder import SimConfig

    responder = ModelResponder(model_dir, SimConfig(reasoning_words=(12, 20), content_words=(12, 20)))
    rows = []
    for i in range(SAMPLES):
        messages = [{"role": "user", "content": f"Question {i}: what should I know about topic number {i * 7 + 3}?"}]
        prompt = list(responder.prompt_ids_for_messages(messages))
        answer = list(responder.sample(tuple(prompt), None).output_ids)
        rows.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return rows


def write_run(run_dir: Path, model_dir: Path, rows: list[tuple[list[int], list[int]]]) -> None:
    n = len(rows)
    table = pa.table(
        {
            "sample_id": [f"g{i:03d}" for i in range(n)],
            "dataset": ["greedy"] * n,
            "input_ids": [ids for ids, _ in rows],
            "loss_mask": [mask for _, mask in rows],
            "prompt_len": [mask.count(0) for _, mask in rows],
            "completion_len": [mask.count(1) for _, mask in rows],
            "reasoning_len": [0] * n,
            "completion_format": ["test"] * n,
            "token_source": ["reencoded"] * n,
        },
        schema=TOKENS,
    )
    write_part(PartRef(run_dir, "tokens", 0), table, {"test": True})
    runner = HFHiddenStateRunner.load(model_dir, device="cpu", max_tokens_per_batch=512)
    extract_part(make_cfg(run_dir, model_dir, max_tokens_per_batch=512), 0, runner)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("greedy-run")
    write_run(run_dir, tiny_model_dir, greedy_samples(tiny_model_dir))
    summary = train_run(run_dir, run_dir / "train", OPTIONS)
    evaluation = evaluate_run(run_dir, run_dir / "train", max_new_tokens=24)
    return {"run_dir": run_dir, "summary": summary, "evaluation": evaluation}


def test_training_beats_an_untrained_drafter_on_heldout_prompts(trained: dict[str, Any]) -> None:
    walk, base = trained["evaluation"]["walk"], trained["evaluation"]["baseline"]
    held = trained["evaluation"]["heldout_rows"]
    assert held == trained["summary"]["export"]["validation_samples"] and 3 <= held <= 12  # by prompt hash
    assert walk["verify_steps"] > 0 and base["verify_steps"] > 0
    # An untrained drafter (random decoder over a 512-token draft vocabulary) essentially never guesses the
    # target's next token; the trained one must accept at least one draft per verify step on average, a margin
    # of ~1 token that chance (p ~ 1/512 per draft) cannot produce.
    assert base["mean_accepted_length"] < 0.1
    assert walk["mean_accepted_length"] >= base["mean_accepted_length"] + 1.0
    assert walk["tokens_per_verify_step"] == pytest.approx(1 + walk["mean_accepted_length"])
    first, second, third = walk["per_position_acceptance"]
    assert first > 0.5 and 0 <= second <= 1 and 0 <= third <= 1
    per_prompt = walk["per_prompt"]  # what the interval over prompts resamples: one entry per walked prompt
    assert len(per_prompt) == trained["evaluation"]["heldout_prompts_walked"]
    assert sum(s for _, s in per_prompt) == walk["verify_steps"]
    assert sum(a for a, _ in per_prompt) / walk["verify_steps"] == pytest.approx(walk["mean_accepted_length"])
    low, high = walk["mean_accepted_length_interval_95"]
    assert low <= walk["mean_accepted_length"] <= high
    assert f"| trained | {walk['mean_accepted_length']:.3f} | {low:.3f}-{high:.3f} |" in evaluation_markdown(
        trained["evaluation"]
    )


def test_evaluate_agrees_with_the_trainers_own_validation_metric(trained: dict[str, Any]) -> None:
    """Same held-out rows, independent code: our KV-cache drafting loop vs speculators' TTT unroll."""
    cross = trained["evaluation"]["cross_check"]
    assert cross["trainer_full_acc"] is not None and len(cross["trainer_full_acc"]) == 3
    assert cross["trainer_full_acc"][0] > 0.5  # the comparison is between non-trivial figures
    assert cross["max_abs_diff"] <= TOLERANCE and cross["agrees"]
    assert trained["evaluation"]["teacher_forced"]["positions"] > 20 * trained["evaluation"]["heldout_rows"]


def test_checkpoint_loads_with_the_trainers_own_from_pretrained(trained: dict[str, Any], tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    summary = trained["summary"]
    model = Eagle3DraftModel.from_pretrained(summary["checkpoint"])
    assert model.config.eagle_aux_hidden_state_layer_ids == speculators_layer_ids([1, 3, 4]) == [2, 4, 5]
    assert model.config.draft_vocab_size == 512 and model.d2t.shape == (512,)
    embed = load_file(str(tiny_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight.to(embed.dtype), embed)  # the verifier's, loaded by the trainer
    assert summary["speculators_version"] == "0.9.0"
    # On a GPU (bench/gpu_extract.sh runs this module there) the trainer runs as in production: FlexAttention and
    # the fused Triton loss, which no CPU run can exercise.
    on_gpu = torch.cuda.is_available()
    assert summary["device"] == ("accelerator" if on_gpu else "cpu")
    implementations = (summary["options"]["draft_attn_impl"], summary["options"]["loss_implementation"])
    assert implementations == (("simple_flex_attention", "fused") if on_gpu else ("sdpa", "eager"))
    assert summary["steps"] > 0 and len(summary["val_metrics"]) == OPTIONS.epochs


def test_metrics_and_report_section(trained: dict[str, Any]) -> None:
    run_dir: Path = trained["run_dir"]
    summary = json.loads((run_dir / "train" / "train_summary.json").read_text())
    losses = [m["loss"] for m in summary["train_metrics"]]
    assert losses[-1] < losses[0]
    assert (run_dir / "train" / "evaluation.json").is_file()


@pytest.mark.usefixtures("prefect_harness")
def test_train_flow_publishes_metrics_and_acceptance_as_artifacts(trained: dict[str, Any]) -> None:
    """The Prefect layer over the same output directory: the finished training is reused, not redone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.train_flow import train_flow

    run_dir: Path = trained["run_dir"]
    state = train_flow(
        str(run_dir), str(run_dir / "train"), OPTIONS.__dict__, evaluate_kwargs={"max_new_tokens": 8}, return_state=True
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert result["train"]["resumed"] == "finished"
    assert result["evaluate"]["walk"]["k"] == 3
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    keys = {a.key or "" for a in artifacts}
    assert {a.type for a in artifacts} == {"table", "markdown"}
    for what in ("drafter-val-metrics", "drafter-train-metrics", "drafter-acceptance"):
        assert any(k.startswith(what) for k in keys), (what, keys)
    val_table = next(a for a in artifacts if "drafter-val-metrics" in (a.key or ""))
    assert "full_acc_0_epoch" in json.dumps(val_table.data)


def test_training_resumes_from_its_checkpoints(trained: dict[str, Any]) -> None:
    """The same options again return the finished summary; one more epoch resumes from the last checkpoint and
    trains only that epoch (multipack batching gives 7-8 steps an epoch here), not all of them from scratch."""
    run_dir: Path = trained["run_dir"]
    first = trained["summary"]
    again = train_run(run_dir, run_dir / "train", OPTIONS)
    assert again["resumed"] == "finished" and again["checkpoint"] == first["checkpoint"]
    longer = TrainOptions(**{**OPTIONS.__dict__, "epochs": OPTIONS.epochs + 1})
    resumed = train_run(run_dir, run_dir / "train", longer)
    assert resumed["resumed_from_checkpoints"] == [str(e) for e in range(OPTIONS.epochs)]
    assert 0 < resumed["steps"] <= 2 * first["steps"] // OPTIONS.epochs
    assert resumed["checkpoint"].endswith(f"/{OPTIONS.epochs}")
    assert resumed["val_metrics"][-1]["epoch"] == OPTIONS.epochs


def test_walk_statistics() -> None:
    stats = WalkStats(3)
    for proposed, accepted in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        stats.add(proposed, accepted)
    out = stats.as_dict()
    assert out["mean_accepted_length"] == 6 / 4 and out["tokens_per_verify_step"] == 10 / 4
    # draft 1 reached 4 times, accepted 3; draft 2 reached 3 times (not after the 0), accepted 2; draft 3 reached
    # once (the 2-draft step proposed no third), accepted once
    assert out["per_position_acceptance"] == [3 / 4, 2 / 3, 1 / 1]
    assert out["per_position_accepted_rate"] == [3 / 4, 2 / 4, 1 / 3]


def test_drafter_maps_draft_ids_to_target_ids(trained: dict[str, Any]) -> None:
    drafter = Drafter.load(trained["summary"]["checkpoint"])
    assert drafter.uses_draft_vocab and drafter.d2t is not None and drafter.t2d is not None
    ids = torch.arange(512)
    targets = drafter.to_target_ids(ids)
    assert bool(drafter.t2d[targets].all()) and len(set(targets.tolist())) == 512


def test_evaluate_walks_exactly_the_prompts_of_a_file(
    trained: dict[str, Any], tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`evaluate --prompts FILE`: the walk decodes from those prompts, rendered with the target's chat template,
    in file order, and from nothing else; a malformed row is one line naming it."""
    from flows.cli import main
    from flows.exit_codes import ExitCode
    from tasks.common.config import TokenizerConfig
    from tasks.common.messages import Message
    from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt_ids

    questions = ["What is a NOR gate?", "Name three rivers in Europe.", "Why is the sky blue?"]
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    run_dir: Path = trained["run_dir"]
    result = evaluate_run(run_dir, run_dir / "train", max_new_tokens=8, baseline=False, prompts_file=path)
    tokenizer = load_tokenizer(TokenizerConfig(path=tiny_model_dir))
    expected = [render_prompt_ids(tokenizer, [Message(role="user", content=q)]) for q in questions]
    assert result["walked_prompts"] == expected and result["heldout_source"] == "prompts_file"
    assert result["walk"]["prompts"] == 3 and result["walk"]["generated_tokens"] == 3 * 8
    assert sum(result["walk"]["target_decodes"].values()) == 3  # this evaluation's own target decoded all three

    path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": []}\n')
    capsys.readouterr()  # what the walk above printed
    assert main(["evaluate", str(run_dir), "--prompts", str(path), "--no-prefect"]) == ExitCode.USER
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "row 1" in err and str(path) in err
