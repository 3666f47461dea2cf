"""`EAGLE3_DEMO_BLOCKS=1 deployments/setup.sh`, re-run to redeploy as the README says, keeps the blocks a user
saved under the demo's names (a UI probe: the endpoint's API key was reset to none)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.usefixtures("prefect_harness")
def test_rerunning_the_demo_blocks_keeps_the_users_blocks_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from blocks import ArtifactStoreBlock, InferenceEndpointBlock

    monkeypatch.syspath_prepend(str(REPO / "deployments"))
    sys.modules.pop("demo_blocks", None)
    import demo_blocks

    names = ("eagle3-endpoint", "eagle3-runs", "eagle3-gpu-backend")
    try:
        InferenceEndpointBlock(base_url="https://example.invalid/api", model="mine", api_key="sk-mine").save(
            "eagle3-endpoint", overwrite=True
        )
        demo_blocks.main(["--runs-dir", str(tmp_path / "runs")])
        out = capsys.readouterr().out
        assert (
            "saved demo blocks eagle3-runs, eagle3-gpu-backend" in out and "kept existing blocks eagle3-endpoint" in out
        )
        mine = InferenceEndpointBlock.load("eagle3-endpoint")
        assert mine.model == "mine" and mine.api_key is not None
        assert mine.api_key.get_secret_value() == "sk-mine"
        assert ArtifactStoreBlock.load("eagle3-runs").location == str(tmp_path / "runs")

        demo_blocks.main(["--runs-dir", str(tmp_path / "other")])
        assert "kept existing blocks eagle3-endpoint, eagle3-runs, eagle3-gpu-backend" in capsys.readouterr().out
        assert ArtifactStoreBlock.load("eagle3-runs").location == str(tmp_path / "runs")

        demo_blocks.main(["--runs-dir", str(tmp_path / "other"), "--force"])
        assert f"saved demo blocks {', '.join(names)}" in capsys.readouterr().out
        assert InferenceEndpointBlock.load("eagle3-endpoint").model == "sim/deepseek-v4-sim"
    finally:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for doc in client.read_block_documents(include_secrets=False):
                if doc.name in names:
                    client.delete_block_document(doc.id)
