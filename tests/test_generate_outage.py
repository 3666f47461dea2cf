"""An endpoint that goes away as a whole: its samples must not be marked failed. A short outage is ridden out
(retries past max_attempts do not count), a long one stops the run resumably with EndpointUnavailableError."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from endpoint_sim.server import SimConfig, SimulatorServer
from tasks.common.errors import EndpointUnavailableError
from tasks.common.shards import PartRef
from tasks.generate.chunks import chunk_paths
from tests.test_generate_failures import committed_chunks, make_cfg, question, responses, run, write_prompts

SAMPLES = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_an_outage_longer_than_outage_abort_s_stops_the_run_without_failing_samples(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_prompts(tmp_path, [question("down", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path,
        f"http://127.0.0.1:{free_port()}",
        tokenizer_dir,
        "chat",
        max_attempts=2,
        outage_grace_s=0.0,
        outage_abort_s=1.0,
    )
    with pytest.raises(EndpointUnavailableError, match="no successful answer") as raised:
        run(cfg, tokenizer)
    assert "rerun to resume" in str(raised.value)
    assert committed_chunks(tmp_path) == {}, "an outage must not turn samples into failed rows"
    assert not PartRef(tmp_path, "responses", 0).is_done()


def test_a_short_outage_is_ridden_out_beyond_max_attempts(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    port = free_port()
    write_prompts(tmp_path, [question("blip", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path,
        f"http://127.0.0.1:{port}",
        tokenizer_dir,
        "chat",
        max_attempts=2,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        outage_grace_s=0.0,
        outage_abort_s=60.0,
    )
    server = SimulatorServer(tokenizer_dir, SimConfig(), port=port)
    comes_back = threading.Timer(1.0, server.start)
    comes_back.start()
    try:
        summary = run(cfg, tokenizer).total()
    finally:
        comes_back.join()
        server.stop()
    got = responses(tmp_path)
    assert summary["done"] == SAMPLES and {r["status"] for r in got.values()} == {"done"}
    assert max(r["attempts"] for r in got.values()) > cfg.endpoint.max_attempts, "refused attempts were not free"
    assert summary["retries_by_reason"].get("connection", 0) > 0
    assert chunk_paths(tmp_path, 0) == []


def test_refused_connections_never_use_up_attempts_whatever_the_grace(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The old rule charged attempts before outage_grace_s: a down endpoint failed every sample in seconds."""
    write_prompts(tmp_path, [question("refused", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path,
        f"http://127.0.0.1:{free_port()}",
        tokenizer_dir,
        "chat",
        max_attempts=2,
        outage_grace_s=30.0,
        outage_abort_s=1.0,
    )
    with pytest.raises(EndpointUnavailableError):
        run(cfg, tokenizer)
    assert committed_chunks(tmp_path) == {}
