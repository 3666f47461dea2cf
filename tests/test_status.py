"""`eagle3-datagen status`: counts reconciled across stages by sample id, stale parts named, failed and
quarantined samples written to a file, and the exit codes; plus the empty-input error and generate's gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from endpoint_sim.responder import FailureRule
from endpoint_sim.server import SimConfig, SimulatorServer
from flows.cli import EXIT_ERROR, EXIT_GATE, EXIT_INCONSISTENT, main
from tasks.common.config import load_config
from tasks.common.errors import EmptyInputError
from tasks.prepare.datasets import prepare_datasets
from tasks.reconstruct.completion_format import format_for
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.tokenizer_loading import load_tokenizer
from tasks.status.report import run_status
from tasks.validate.checks import validate_part
from tests.conftest import DEMO_DATA

SAMPLES = 12


def _config(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, data: Path, **extra: Any) -> Path:
    config = {
        "run_dir": str(tmp_path / "run"),
        "samples_per_shard": 6,
        "datasets": [{"name": "B1", "path": str(data), "max_samples": SAMPLES}],
        "endpoint": {
            "base_url": sim.base_url,
            "model": "sim/deepseek-v4-sim",
            "max_in_flight": 8,
            "max_attempts": 2,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.02,
        },
        "sampling": {"max_tokens": 1024},
        "tokenizer": {"path": str(tokenizer_dir)},
        "extract": {"enabled": False},
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _data(tmp_path: Path) -> Path:
    """Demo B1 plus one malformed line up front, so a quarantined row is always there to be listed."""
    path = tmp_path / "b1.jsonl"
    path.write_text('{"messages": "not a list"}\n' + (DEMO_DATA / "demo_b1.jsonl").read_text())
    return path


def _cpu_stages(config: Path, parts: list[int]) -> None:
    cfg = load_config(config)
    fmt = format_for(cfg, load_tokenizer(cfg.tokenizer))
    for part in parts:
        reconstruct_part(cfg, part, fmt)
        validate_part(cfg, part, fmt)


def test_status_reconciles_stages_lists_failures_and_flags_stale_parts(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _data(tmp_path)
    config = _config(tmp_path, sim, tokenizer_dir, data)
    run_dir = tmp_path / "run"
    sim.update_config(failures=(FailureRule(status=500, rate=0.5, attempts=None),))
    assert main(["generate", str(config), "--no-progress"]) == EXIT_GATE
    err = capsys.readouterr().err
    assert "max_failed_rate 0.05" in err and "input rows quarantined (B1 " in err

    _cpu_stages(config, [0])  # part 1's tokens and validation are never built: "responses N, tokens M"
    failed_out = tmp_path / "failed.jsonl"
    assert main(["status", str(run_dir), "--config", str(config), "--failed-out", str(failed_out)]) == EXIT_INCONSISTENT
    err = capsys.readouterr().err
    assert "stages disagree" in err and "tokens" in err

    status = run_status(run_dir, extract_enabled=False)
    counts = status.counts["B1"]
    assert counts["prompts"].expected == counts["responses"].expected == SAMPLES
    failed = counts["responses"].failed
    assert 0 < failed < SAMPLES and counts["responses"].failed_by_reason == {"http_500": failed}
    assert counts["responses"].failed_by_class == {"transient": failed}
    assert counts["tokens"].expected == SAMPLES - failed == counts["tokens"].done + counts["tokens"].missing
    assert counts["tokens"].missing > 0 and status.parts["tokens"].missing == []
    lines = [json.loads(line) for line in failed_out.read_text().splitlines()]
    generation = [x for x in lines if x["stage"] == "responses"]
    assert len(generation) == failed and {x["reason"] for x in generation} == {"http_500"}
    quarantined = [x for x in lines if x["stage"] == "prepare"]
    assert quarantined and quarantined[0]["source_row"] == 0 and "messages" in quarantined[0]["reason"]

    _cpu_stages(config, [0, 1])
    assert main(["status", str(run_dir), "--config", str(config), "--failed-out", str(failed_out)]) == 0

    sim.update_config(failures=())  # the rerun retries the failed samples: responses parts change under tokens
    assert main(["generate", str(config), "--no-progress"]) == 0
    status = run_status(run_dir, extract_enabled=False)
    assert not status.consistent
    assert status.parts["tokens"].stale and status.parts["validation"].stale
    assert status.counts["B1"]["tokens"].stale == SAMPLES - failed
    assert status.counts["B1"]["tokens"].missing == failed

    _cpu_stages(config, [0, 1])
    status = run_status(run_dir, extract_enabled=False)
    assert status.consistent, status.problems
    assert status.counts["B1"]["validation"].expected == SAMPLES
    # Only validation's own verdicts remain: the simulator writes raw tool-call text into some answers, which the
    # default tool_call_policy fails; no generate failure survives the rerun.
    assert all(f["stage"] == "validation" and "tool_call_markup" in f["reason"] for f in status.failed)

    cfg = load_config(config, {"reconstruct.loss_on_reasoning": False})
    fmt = format_for(cfg, load_tokenizer(cfg.tokenizer))
    from tasks.status.plan import recipe_digests

    assert run_status(run_dir, extract_enabled=False).consistent, "inputs alone: nothing changed"
    assert run_status(run_dir, recipe_digests(cfg, fmt), extract_enabled=False).parts["tokens"].stale == [0, 1]


def test_an_input_without_valid_rows_is_one_clear_error(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": []}\nnot json\n{"conversations": [{"from": "gpt", "value": "hi"}]}\n')
    config = _config(tmp_path, sim, tokenizer_dir, data)
    with pytest.raises(EmptyInputError, match=r"dataset B1: no valid rows in .*bad\.jsonl \(3 rows read, 3 quarant"):
        prepare_datasets(load_config(config))
    assert main(["generate", str(config), "--no-progress"]) == EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no valid rows" in err[0] and "Traceback" not in err[0]
    assert len((tmp_path / "run" / "prompts" / "_quarantine.jsonl").read_text().splitlines()) == 3


@pytest.mark.usefixtures("prefect_harness")
def test_run_exits_at_the_failed_rate_gate_and_the_failure_summary_lists_the_samples(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect.artifacts import Artifact

    from flows.cli import demo_config_path

    faults = SimConfig(failures=(FailureRule(status=500, rate=0.5, attempts=None),))
    with SimulatorServer(tiny_model_dir, faults) as sim:
        sets = {
            "run_dir": str(tmp_path / "run"),
            "endpoint.base_url": sim.base_url,
            "endpoint.max_attempts": 2,
            "tokenizer.path": str(tiny_model_dir),
            "extract.enabled": "false",
            "datasets": json.dumps([{"name": "B1", "path": str(_data(tmp_path)), "max_samples": SAMPLES}]),
        }
        argv = ["run", str(demo_config_path()), "--no-progress"]
        for key, value in sets.items():
            argv += ["--set", f"{key}={value}"]
        assert main(argv) == EXIT_GATE
    err = capsys.readouterr().err
    assert "error: validation gates crossed" in err and "max_failed_rate 0.05" in err
    summary = Artifact.get("failure-summary-run")
    assert summary is not None and "http_500" in str(summary.data)
    lines = (tmp_path / "run" / "failed_samples.jsonl").read_text().splitlines()
    assert any(json.loads(line)["reason"] == "http_500" for line in lines)


def test_status_reuses_its_last_result_only_while_no_marker_quarantine_or_setting_changed(tmp_path: Path) -> None:
    """Every run ends with a status pass: the result is kept with a key over every marker's bytes, the quarantine
    file and the settings asked about, so a no-op status reads markers and one file, and any rewritten part, new
    quarantined row or other recipe gives a result computed from the parts again."""
    import pyarrow as pa

    from tasks.common.schemas import PROMPTS
    from tasks.common.shards import PartRef, write_part
    from tasks.status.status_cache import CACHE_FILE

    def prompts(ids: list[str]) -> pa.Table:
        rows = [
            {"sample_id": i, "dataset": "D", "source_file": "d.jsonl", "source_row": n, "prompt_id": i}
            | {"messages": [{"role": "user", "content": f"question {i}"}], "sample_index": 0}
            for n, i in enumerate(ids)
        ]
        return pa.Table.from_pylist(rows, schema=PROMPTS)

    def expected() -> int:
        return run_status(run_dir, extract_enabled=False).counts["D"]["prompts"].expected

    run_dir = tmp_path / "run"
    ref = PartRef(run_dir, "prompts", 0)
    write_part(ref, prompts(["a", "b"]), {})
    first = run_status(run_dir, extract_enabled=False)
    cache = run_dir / CACHE_FILE
    written = cache.read_bytes()
    assert run_status(run_dir, extract_enabled=False).to_dict() == first.to_dict()
    assert cache.read_bytes() == written, "nothing changed: the stored result is reused"

    write_part(ref, prompts(["a", "b", "c"]), {})
    assert expected() == 3, "a rewritten part was answered from the stored result"
    key = json.loads(cache.read_text())["key"]
    write_part(ref, prompts(["a", "b", "c"]), {})  # the same rows again: a new marker (its time), a new key
    assert expected() == 3 and json.loads(cache.read_text())["key"] != key

    write_part(PartRef(run_dir, "prompts", 1), prompts(["d"]), {})
    ref.marker.unlink()  # a part whose marker is gone counts as missing at once
    assert expected() == 1
    assert run_status(run_dir, extract_enabled=False).parts["prompts"].missing == [0]

    quarantine = run_dir / "prompts" / "_quarantine.jsonl"
    quarantine.write_text(json.dumps({"dataset": "Q", "reason": "no messages"}) + "\n")
    status = run_status(run_dir, extract_enabled=False)
    assert "Q" in status.counts and len(status.quarantined) == 1

    on = run_status(run_dir, extract_enabled=True)
    assert "hidden_states" in on.stages and "hidden_states" not in status.stages, "settings are part of the key"

    cache.write_text("{not json")
    assert expected() == 1


def test_rows_validation_dropped_are_not_expected_in_hidden_states(
    tmp_path: Path, sim: SimulatorServer, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Extraction never takes a row validation dropped (tool-call markup under `tool_call_policy: drop`, an answer
    with nothing left after a cut character): `status` expected its hidden states anyway, so such a run said
    "stages disagree" and exited 6 after every rerun (an independent re-verifier)."""
    from tasks.extract.hf_backend import HFHiddenStateRunner
    from tasks.extract.stage import extract_part

    config = _config(
        tmp_path,
        sim,
        tiny_model_dir,
        DEMO_DATA / "demo_b1.jsonl",
        extract={"enabled": True, "max_tokens_per_batch": 512},
        validation={"tool_call_policy": "drop"},
    )
    assert main(["generate", str(config), "--no-progress"]) == 0
    _cpu_stages(config, [0, 1])
    cfg = load_config(config)
    runner = HFHiddenStateRunner.load(tiny_model_dir, device="cpu", max_tokens_per_batch=512)
    for part in (0, 1):
        extract_part(cfg, part, runner)
    status = run_status(tmp_path / "run", extract_enabled=True)
    validation = status.counts["B1"]["validation"]
    hidden = status.counts["B1"]["hidden_states"]
    assert validation.done == SAMPLES and hidden.expected == hidden.done < SAMPLES, (validation, hidden)
    assert status.consistent, status.problems
    capsys.readouterr()
    assert main(["status", str(tmp_path / "run"), "--config", str(config)]) == 0


def test_answers_a_killed_run_left_in_the_journal_are_shown_as_kept(tmp_path: Path) -> None:
    """A `kill -9` leaves the last answers in the journal only (the next run replays them): `status` counted
    just committed chunks and showed every one of them as missing, with nothing saying they were paid and kept."""
    from tasks.generate.chunks import journal_dir
    from tasks.generate.journal import AppendLog
    from tasks.status.unfinished import answers_in_unfinished_parts, status_notes

    journal = AppendLog(journal_dir(tmp_path) / "journal-1-1.log", group_commit_s=0.0)
    for sid, status in (("a", "done"), ("b", "failed"), ("b", "done"), ("c", "failed"), ("a", "done")):
        journal.submit({"p": 0, "r": {"sample_id": sid, "dataset": "ds", "status": status}})
    journal.close()
    assert answers_in_unfinished_parts(tmp_path) == {"ds": 2}  # an answer journaled twice is one answer
    from tasks.generate.chunks import unfinished_answer_rows

    assert len(unfinished_answer_rows(tmp_path, set(), ["sample_id", "status"])) == 3  # what the estimate observes
    assert any("2 answers (ds 2)" in line and "responses/_journal" in line for line in status_notes(tmp_path))
