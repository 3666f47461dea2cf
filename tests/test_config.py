from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from flows.retry_policy import is_transient
from tasks.common.config import PipelineConfig, load_config
from tasks.common.errors import ConfigError, FatalEndpointError, SchemaMismatchError

BASE = {
    "run_dir": "run",
    "datasets": [{"name": "B1", "path": "b1.jsonl"}],
    "endpoint": {"model": "m", "api_key": "sk-or-SECRET-123"},
    "tokenizer": {"path": "model"},
}


def write(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "cfg" / "run.yaml"
    path.parent.mkdir(exist_ok=True)
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_paths_resolve_against_the_file_and_overrides_apply(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE), {"endpoint.max_in_flight": 7, "run_dir": str(tmp_path / "x")})
    assert cfg.datasets[0].path == tmp_path / "cfg" / "b1.jsonl"
    assert cfg.tokenizer.path == tmp_path / "cfg" / "model"
    assert cfg.run_dir == tmp_path / "x"
    assert cfg.endpoint.max_in_flight == 7


def test_relative_paths_typed_as_overrides_resolve_against_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--set run_dir=../runs/x` wrote the run relative to wherever a later stage looked, printed relative (a
    newcomer probe): a typed path means what the shell means, and is absolute from then on."""
    here = tmp_path / "work" / "repo"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    cfg = load_config(
        write(tmp_path, BASE),
        {
            "run_dir": "../runs/x",
            "tokenizer.path": "model",
            "datasets": [{"name": "B2", "path": "data/b2.jsonl"}],
            "extract": {"model_path": "/abs/model"},
            "endpoint.model": "relative/looking",
        },
    )
    assert cfg.run_dir == tmp_path / "work" / "runs" / "x"
    assert cfg.tokenizer.path == here / "model" and cfg.datasets[0].path == here / "data" / "b2.jsonl"
    assert str(cfg.extract.model_path) == "/abs/model" and cfg.endpoint.model == "relative/looking"


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"endpoint": {"model": "m", "max_inflight": 3}}, "max_inflight"),
        ({"surprise": 1}, "surprise"),
        ({"endpoint": {"model": "m", "base_url": "ftp://x"}}, "http"),
        ({"datasets": [{"name": "B 1", "path": "x"}]}, "must match"),
        ({"datasets": [{"name": "B1", "path": "x"}, {"name": "B1", "path": "y"}]}, "unique"),
        ({"extract": {"layers": [1, 2]}}, "exactly 3"),
        ({"endpoint": {"model": "m", "max_in_flight": 0}}, "greater than or equal"),
    ],
)
def test_strict_config_rejects(tmp_path: Path, patch: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        load_config(write(tmp_path, {**BASE, **patch}))


def test_secret_never_leaves_through_dump_or_provenance(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.endpoint.resolved_api_key() == "sk-or-SECRET-123"
    for view in (cfg.public_dump(), cfg.provenance(), repr(cfg), str(cfg)):
        assert "SECRET" not in json.dumps(view, default=str)


def test_api_key_env_must_be_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(write(tmp_path, {**BASE, "endpoint": {"model": "m", "api_key_env": "E3_TEST_KEY"}}))
    monkeypatch.delenv("E3_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="E3_TEST_KEY"):
        cfg.endpoint.resolved_api_key()
    monkeypatch.setenv("E3_TEST_KEY", "k")
    assert cfg.endpoint.resolved_api_key() == "k"


def test_config_file_errors_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_only_transport_failures_are_retried_by_prefect() -> None:
    assert is_transient(ConnectionResetError())
    assert is_transient(aiohttp.ServerDisconnectedError())
    assert is_transient(TimeoutError())
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = ConnectionRefusedError()
    assert is_transient(wrapped)
    assert not is_transient(FatalEndpointError("401"))
    assert not is_transient(SchemaMismatchError("v2"))
    assert not is_transient(ValueError("bad row"))
    assert isinstance(PipelineConfig, type)


def test_a_bare_off_in_yaml_means_off(tmp_path: Path) -> None:
    """YAML 1.1 reads `off` as false; the README and configs/run.yaml tell a shared key's user to write it."""
    path = tmp_path / "run.yaml"
    text = "run_dir: run\ndatasets: [{name: B1, path: b1.jsonl}]\ntokenizer: {path: model}\n"
    text += "endpoint: {model: m, account_settlement: off}\nscoring: {parity_gate: off}\n"
    path.write_text(text)
    cfg = load_config(path)
    assert (cfg.endpoint.account_settlement, cfg.scoring.parity_gate) == ("off", "off")
    assert load_config(path, {"endpoint.account_settlement": False}).endpoint.account_settlement == "off"
