"""Session-wide fixtures: one Prefect test harness, one tiny model directory, temp PREFECT_HOME.

Prefect reads its settings at import, so the environment is set here before any test module imports it. It also
binds its console log handler to the sys.stdout of the moment `prefect.main` is first imported: a CLI test importing
it first under `capsys` left every later flow logging into that test's closed capture stream, so it is imported here
(where installed: `bench/gpu_extract.sh` runs the CUDA tests on a GPU host that has no Prefect).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

_PREFECT_HOME = tempfile.mkdtemp(prefix="eagle3-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_UI_ENABLED"] = "false"
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

with contextlib.suppress(ModuleNotFoundError):  # a bare GPU host (bench/gpu_extract.sh) carries no Prefect
    import prefect.main  # noqa: F401  (its console log handler bound to the session's streams, see above)
import pytest  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from endpoint_sim.assets import build_tiny_model_dir, write_tokenizer_dir  # noqa: E402
from endpoint_sim.responder import Responder, SimConfig  # noqa: E402
from endpoint_sim.server import SimulatorServer  # noqa: E402
from tasks.common.config import TokenizerConfig  # noqa: E402
from tasks.reconstruct.tokenizer_loading import load_tokenizer  # noqa: E402
from tests.prefect_cluster import deployed_cluster, start_in_background  # noqa: E402, F401  (one per session)

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "flows" / "data"
CLI_ENTRY = "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"
"""`python -c CLI_ENTRY ARGS...` runs the CLI as the `eagle3-datagen` console script does, from any checkout."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    """The demo tokenizer (DeepSeek-V4 tokenizer.json + DeepSeek-V3.1-thinking template), loaded once."""
    return load_tokenizer(TokenizerConfig(path=tokenizer_dir))


@pytest.fixture(scope="module")
def local(tokenizer_dir: Path) -> Responder:
    """An independent responder in the test thread: predicts what the simulator must answer."""
    return Responder(tokenizer_dir)


@pytest.fixture(scope="module")
def server(tokenizer_dir: Path) -> Iterator[SimulatorServer]:
    """One simulator per test module, on 127.0.0.1."""
    with SimulatorServer(tokenizer_dir, SimConfig()) as srv:
        yield srv


@pytest.fixture()
def sim(server: SimulatorServer, local: Responder) -> SimulatorServer:
    """Baseline knobs and fresh attempt counters, so every test's failure schedule starts at attempt 1."""
    server.update_config(SimConfig())
    server.reset_stats()
    local.update_config(SimConfig())
    return server


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One API server for the in-process flow tests. Flow-run heartbeats are off here, as for the CLI's own
    temporary server (flows/cli.py): nothing watches these runs for crashes, and each flow run would otherwise
    wait up to a second for the heartbeat thread at its end (the deployment tests keep them on)."""
    pytest.importorskip("prefect", reason="Prefect is not installed (a bare GPU host running bench/gpu_extract.sh)")
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """`flows.cli.main(argv)` in this process, as the console script runs it, with stdout and stderr captured;
    the key redactors it registered are dropped afterwards, so one test's key does not shape the next one's."""
    from flows import cli as cli_module

    capsys.readouterr()
    try:
        code = cli_module.main(list(argv))
    finally:
        cli_module._SECRETS.clear()
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out, err)


def pytest_collection_finish(session: pytest.Session) -> None:
    start_in_background(session)
