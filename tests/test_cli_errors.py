"""Every command with every bad input a user makes: one line on stderr, the documented exit code
(flows/exit_codes.py), no traceback, and nothing already in the run directory lost or changed.

`generate`, `estimate` and `export` run in this process through `flows.cli.main` (what the console script
calls); `run` runs as a real subprocess, so Prefect's own logging is the one a user sees, against the session's
Prefect test server instead of starting its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from endpoint_sim.server import SimConfig, SimulatorServer
from flows.exit_codes import EXIT_CODE_MEANINGS, ExitCode
from tests.conftest import CLI_ENTRY, DEMO_DATA, REPO, run_main

API_KEY = "sk-errors-test-4b1d-never-printed"


@pytest.fixture(scope="module")
def sim(tokenizer_dir: Path) -> Iterator[SimulatorServer]:
    with SimulatorServer(tokenizer_dir, SimConfig(required_api_key=API_KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def prefect_api(prefect_harness: None) -> str:
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def write_config(root: Path, sim: SimulatorServer, tokenizer_dir: Path, **changes: Any) -> Path:
    config: dict[str, Any] = {
        "run_dir": str(root / "run"),
        "samples_per_shard": 4,
        "datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl"), "max_samples": 4}],
        "endpoint": {
            "kind": "sglang_generate",
            "base_url": sim.base_url,
            "model": "sim/tiny",
            "api_key_env": "EAGLE3_TEST_KEY",
            "max_in_flight": 4,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
        },
        "sampling": {"max_tokens": 256},
        "tokenizer": {"path": str(tokenizer_dir)},
        "extract": {"enabled": False},
    }
    for dotted, value in changes.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snapshot(root: Path) -> dict[str, str]:
    """Finished work: every part, chunk and marker (a manifest may be rewritten; finished data never)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (p.suffix == ".parquet" or p.parent.name == "_done" or p.suffix in (".yaml", ".jsonl"))
    }


def start_cli(*args: str, prefect_api: str | None = None, key: str = API_KEY) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(EAGLE3_TEST_KEY=key, PYTHONPATH=str(REPO), COLUMNS="200")
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    cmd = [sys.executable, "-c", CLI_ENTRY, *args]
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def cli(*args: str, prefect_api: str | None = None, key: str = API_KEY) -> subprocess.CompletedProcess[str]:
    return finished(start_cli(*args, prefect_api=prefect_api, key=key))


def call(capsys: pytest.CaptureFixture[str], *args: str, key: str = API_KEY) -> subprocess.CompletedProcess[str]:
    """`main(args)` in this process, as the console script runs it; stdout and stderr captured."""
    os.environ["EAGLE3_TEST_KEY"] = key
    return run_main(capsys, *args)


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: ExitCode, *needles: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}\nstdout:\n{result.stdout[-3000:]}"
    assert result.returncode == code, (result.returncode, lines[0])
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    assert API_KEY not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _bad_inputs(root: Path, sim: SimulatorServer, tokenizer_dir: Path) -> dict[str, tuple[Path, ExitCode, str]]:
    """name -> (config, expected code, a word the message must contain); each config in its own folder."""
    cases: dict[str, tuple[dict[str, Any], ExitCode, str]] = {
        "config typo": (
            {"endpoint.max_inflight": 4},
            ExitCode.USER,
            "endpoint.max_inflight: Extra inputs are not permitted (did you mean endpoint.max_in_flight",
        ),
        "missing dataset": ({"datasets": [{"name": "B1", "path": str(root / "nope.jsonl")}]}, ExitCode.USER, "nope"),
        "dead endpoint": (  # waited for up to outage_abort_s (as during a run), then refused with nothing sent
            {"endpoint.base_url": _dead_url(), "endpoint.outage_abort_s": 2},
            ExitCode.ENDPOINT,
            "unreachable",
        ),
        "empty dataset": ({"datasets": [{"name": "E", "path": "EMPTY"}]}, ExitCode.USER, "no rows"),
        "all rows quarantined": ({"datasets": [{"name": "Q", "path": "GARBAGE"}]}, ExitCode.USER, "quarantined"),
        "run_dir under a file": ({"run_dir": "FILE/run"}, ExitCode.USER, "is a file"),
        "format the tokenizer lacks": (  # estimate priced it as if generate would run
            {"tokenizer.completion_format": "kimi_k25_thinking"},
            ExitCode.USER,
            "kimi_k25_thinking",
        ),
        "unset key variable": (  # reported before any dataset is read (`run`: before Prefect started)
            {"endpoint.api_key_env": "EAGLE3_KEY_NOBODY_SET"},
            ExitCode.USER,
            "endpoint.api_key_env names 'EAGLE3_KEY_NOBODY_SET', which is unset or empty",
        ),
        "no tokenizer files": (  # reported before the endpoint is waited for (`run` waited first)
            {"tokenizer.path": "NOTOKENIZER", "endpoint.base_url": _dead_url(), "endpoint.outage_abort_s": 60},
            ExitCode.USER,
            "holds no tokenizer files",
        ),
    }
    out = {}
    for name, (changes, code, needle) in cases.items():
        folder = root / name.replace(" ", "-")
        folder.mkdir()
        (folder / "empty.jsonl").write_text("")
        (folder / "garbage.jsonl").write_text('{"nope": 1}\nnot json\n{"messages": []}\n')
        (folder / "file").write_text("I am a file")
        (folder / "not-a-tokenizer").mkdir()
        resolved: dict[str, Any] = {}
        for key, value in changes.items():
            text = json.dumps(value)
            text = text.replace('"EMPTY"', json.dumps(str(folder / "empty.jsonl")))
            text = text.replace('"GARBAGE"', json.dumps(str(folder / "garbage.jsonl")))
            text = text.replace('"FILE/run"', json.dumps(str(folder / "file" / "run")))
            text = text.replace('"NOTOKENIZER"', json.dumps(str(folder / "not-a-tokenizer")))
            resolved[key] = json.loads(text)
        out[name] = (write_config(folder, sim, tokenizer_dir, **resolved), code, needle)
    return out


def test_generate_and_estimate_with_each_bad_input(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, (config, code, needle) in _bad_inputs(tmp_path, sim, tokenizer_dir).items():
        before = snapshot(config.parent)
        assert_one_line_error(call(capsys, "generate", str(config), "--no-progress"), code, needle)
        if name == "unset key variable":  # said before the datasets were read into prompts parts
            assert not list((config.parent / "run").rglob("*.parquet"))
        if name not in ("dead endpoint", "run_dir under a file", "unset key variable"):  # estimate sends nothing
            assert_one_line_error(call(capsys, "estimate", str(config)), code, needle)
        after = snapshot(config.parent)
        assert all(after.get(path) == digest for path, digest in before.items()), f"{name}: files changed"


def test_a_refused_key_and_an_unwritable_run_dir(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = write_config(
        tmp_path,
        sim,
        tokenizer_dir,
        **{"datasets": [{"name": "B1", "path": str(DEMO_DATA / "demo_b1.jsonl"), "max_samples": 2}]},
    )
    assert call(capsys, "generate", str(first), "--no-progress").returncode == 0
    before = snapshot(tmp_path / "run")
    more = write_config(tmp_path, sim, tokenizer_dir)  # two more samples to send, to a key the endpoint refuses
    refused = call(capsys, "generate", str(more), "--no-progress", key="sk-wrong")
    assert_one_line_error(refused, ExitCode.ENDPOINT, "401")
    after = snapshot(tmp_path / "run")
    assert all(after.get(path) == digest for path, digest in before.items()), "finished work lost"
    bad_set = call(capsys, "generate", str(more), "--set", "endpoint.max_in_flight")
    assert_one_line_error(bad_set, ExitCode.USER, "KEY=VALUE")
    if os.geteuid() != 0:  # root writes through any mode bits; "run_dir under a file" covers it there
        (tmp_path / "run").chmod(0o555)
        try:
            locked = call(capsys, "generate", str(more), "--no-progress")
            assert_one_line_error(locked, ExitCode.USER, "writable")
        finally:
            (tmp_path / "run").chmod(0o755)


def test_export_without_hidden_states(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, sim, tokenizer_dir)
    assert call(capsys, "generate", str(config), "--no-progress").returncode == 0
    before = snapshot(tmp_path / "run")
    for run_dir in (tmp_path / "run", tmp_path / "missing"):
        result = call(capsys, "export", str(run_dir), "--format", "speculators", "--out", str(tmp_path / "out"))
        assert_one_line_error(result, ExitCode.USER, str(run_dir))
    assert snapshot(tmp_path / "run") == before


def test_train_and_evaluate_refuse_a_run_with_nothing_to_use_before_prefect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`evaluate` of a directory with no trained drafter started a temporary Prefect server and printed its flow
    and task failure logs around the one error line (a newcomer probe); `train` said "run extract first" about a
    directory that does not exist. Both now check before Prefect starts."""
    (tmp_path / "run").mkdir()
    for args, needle in (
        (("evaluate", str(tmp_path / "missing")), "has no train_summary.json"),
        (("evaluate", str(tmp_path / "run")), "has no train_summary.json"),
        (("evaluate", str(tmp_path / "run"), "--prompts", str(tmp_path / "none.jsonl")), "no such file"),
        (("train", str(tmp_path / "missing")), "does not exist on this host"),
        (("train", str(tmp_path / "run")), "no finished hidden_states parts"),
    ):
        result = call(capsys, *args)
        assert_one_line_error(result, ExitCode.USER, needle)
        assert "temporary server" not in result.stdout + result.stderr, args


def test_run_stops_before_prefect_on_what_a_preflight_can_see(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config typo, a missing dataset, a dead endpoint, an unusable run_dir: `run` says so before it starts a
    Prefect server (or imports Prefect's flow machinery), so in this process is where a user would see it."""
    cases = _bad_inputs(tmp_path, sim, tokenizer_dir)
    saved = {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")}
    try:
        for name in (
            "config typo",
            "missing dataset",
            "dead endpoint",
            "run_dir under a file",
            "unset key variable",
            "no tokenizer files",
        ):
            config, code, needle = cases[name]
            before = snapshot(config.parent)
            assert_one_line_error(call(capsys, "run", str(config), "--no-progress"), code, needle)
            if name == "unset key variable":
                assert not list((config.parent / "run").rglob("*.parquet"))
            after = snapshot(config.parent)  # prompts parts are prepared before the endpoint is waited for
            assert all(after.get(path) == digest for path, digest in before.items()), f"{name}: files changed"
    finally:  # cmd_run sets Prefect's environment defaults for the flow it would have started
        for key in [k for k in os.environ if k.startswith("PREFECT_")]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


@pytest.mark.slow  # moved to make test-long (CI runs both) to keep make test near 6 minutes
def test_run_reports_prefect_failures_as_one_line(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path, prefect_api: str
) -> None:
    """Through the Prefect flow, as a real process: a 401 (once a misleading 'no running event loop' and 2-9
    tracebacks) and an input whose rows are all quarantined."""
    config, code, needle = _bad_inputs(tmp_path, sim, tokenizer_dir)["all rows quarantined"]
    (tmp_path / "refused").mkdir()
    ok = write_config(tmp_path / "refused", sim, tokenizer_dir)
    before = snapshot(config.parent)
    # two independent runs (own folders, own run directories), side by side: each is seconds of start-up
    quarantined = start_cli("run", str(config), "--no-progress", prefect_api=prefect_api)
    refusing = start_cli("run", str(ok), "--no-progress", prefect_api=prefect_api, key="sk-wrong")
    assert_one_line_error(finished(quarantined), code, needle)
    after = snapshot(config.parent)
    assert all(after.get(path) == digest for path, digest in before.items()), "files changed"
    refused = finished(refusing)
    assert_one_line_error(refused, ExitCode.ENDPOINT, "401")
    assert "no running event loop" not in refused.stdout


def test_help_documents_the_exit_codes_and_every_option() -> None:
    from flows.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    for code, meaning in EXIT_CODE_MEANINGS.items():
        assert f"{int(code)}  {meaning}" in text
    readme = (REPO / "README.md").read_text()
    assert all(f"| {int(code)} |" in readme for code in EXIT_CODE_MEANINGS), "README's exit-code table"
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():  # type: ignore[union-attr]
        assert "exit codes" in sub.format_help(), name
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("eagle3-datagen ")


def test_debug_adds_the_traceback_and_keeps_the_exit_code(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`--debug` re-raised the error, so every failure exited 1 (a bug) instead of its documented code."""
    missing = str(tmp_path / "missing.yaml")
    plain = run_main(capsys, "estimate", missing)
    debug = run_main(capsys, "--debug", "estimate", missing)
    from flows import cli_common

    cli_common.DEBUG = False
    assert plain.returncode == debug.returncode == ExitCode.USER
    assert "Traceback" in debug.stderr and "Traceback" not in plain.stderr
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip().splitlines()[-1]


def test_a_key_typed_without_a_space_after_the_colon_is_not_printed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`{api_key:sk-...}` (flow style, no space) is one unknown key in YAML whose name holds the key: the error
    names the location with the value masked, on the command line and in a flow run's state."""
    from flows.params import RunParameters, resolve_run
    from tasks.common.errors import ConfigError

    config = yaml.safe_load((REPO / "configs" / "run.yaml").read_text())
    path = tmp_path / "configs" / "run.yaml"
    path.parent.mkdir()
    text = yaml.safe_dump(config).replace("endpoint:\n", f"endpoint:\n  api_key:{API_KEY}: null\n", 1)
    path.write_text(text)
    failed = run_main(capsys, "estimate", str(path))
    assert failed.returncode == ExitCode.USER and API_KEY not in failed.stderr + failed.stdout
    assert "endpoint.api_key:***: Extra inputs are not permitted (did you mean endpoint.api_key" in failed.stderr
    debug = run_main(capsys, "--debug", "estimate", str(path))  # pydantic's own text in the traceback named it
    from flows import cli_common

    cli_common.DEBUG = False
    assert "Traceback" in debug.stderr and API_KEY not in debug.stderr + debug.stdout
    assert debug.returncode == ExitCode.USER
    with pytest.raises(ConfigError) as refused:
        resolve_run(RunParameters(config_path=str(path)))
    assert API_KEY not in str(refused.value) and refused.value.__cause__ is None


def test_prefects_embedded_server_not_starting_in_time_is_one_line_with_its_remedy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under load (~11) `run` exited 1, "internal error: a bug", on Prefect's own "Timed out while attempting to
    connect to ephemeral Prefect API server": a loaded machine, not a bug. The real exception, from a startup
    timeout of 0 s, wrapped as a flow run would wrap it: exit 7 and one line naming the setting to raise and
    PREFECT_API_URL."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    import flows.cli as cli
    from tests.test_generate_outage import free_port

    server = SubprocessASGIServer(port=free_port())
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 0}):
        try:
            with pytest.raises(RuntimeError) as raised:
                server.start()
        finally:
            server.stop()

    def run_that_times_out(args: object) -> int:
        raise ValueError("the flow run crashed") from raised.value

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0")
    subparsers = next(a for a in parser._actions if a.dest == "command")
    subparsers.choices["status"].set_defaults(func=run_that_times_out)  # type: ignore[union-attr]
    code = cli.main(["status", "somewhere"])
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.PREFECT_SERVER == 7 and len(err.splitlines()) == 1, err
    assert "within 0 s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)" in err and "PREFECT_API_URL" in err
    assert "internal error" not in err


def test_the_commands_give_prefects_embedded_server_two_minutes_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefect's 20 s were too few for its embedded server beside three other jobs on 2 cores: `make demo-real`
    exited 7 before anything ran. The commands' default is 120 s; a value the user set is kept."""
    import os

    from flows.cli_common import prefect_env
    from flows.exit_codes import EPHEMERAL_STARTUP_SETTING

    monkeypatch.setenv(EPHEMERAL_STARTUP_SETTING, "set-so-that-undo-removes-it")
    monkeypatch.delenv(EPHEMERAL_STARTUP_SETTING)
    prefect_env()
    assert os.environ[EPHEMERAL_STARTUP_SETTING] == "120"
    monkeypatch.setenv(EPHEMERAL_STARTUP_SETTING, "45")
    prefect_env()
    assert os.environ[EPHEMERAL_STARTUP_SETTING] == "45"
