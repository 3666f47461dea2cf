"""The evaluate stage's target: inside `shared_targets()` one per model, layers and dtype, its greedy decodes shared
between drafters; outside it every evaluation loads its own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.evaluate.acceptance import Target, shared_targets


def test_a_second_evaluation_of_the_same_target_does_not_decode_again(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[tuple[int, ...]] = []
    real_decode = Target._decode

    def counting(self: Target, prompt: Any, max_new_tokens: int) -> list[int]:
        decoded.append(tuple(prompt))
        return real_decode(self, prompt, max_new_tokens)

    monkeypatch.setattr(Target, "_decode", counting)
    prompts = [[1, 5, 9, 13], [1, 7, 7]]
    with shared_targets():
        first = Target.load(tiny_model_dir, [0, 1, 2], "float32")
        decodes = [first.greedy(p, 6) for p in prompts]
        assert decoded == [tuple(p) for p in prompts]
        second = Target.load(tiny_model_dir, [0, 1, 2], "float32")
        assert second is first
        assert [second.greedy(p, 6) for p in prompts] == decodes
        assert len(decoded) == 2  # the second evaluation walked the kept decodes
        for p in prompts:
            assert len(second.greedy(p, 6)) == len(p) + 6 and second.aux(second.greedy(p, 6)).shape[0] == len(p) + 6
    third = Target.load(tiny_model_dir, [0, 1, 2], "float32")
    assert third is not first  # outside the scope nothing is kept
    third.greedy(prompts[0], 6)
    assert len(decoded) == 3


@shared_targets()
def test_other_layers_dtype_or_rebuilt_weights_load_afresh(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    kept = Target.load(copy, [0, 1, 2], "float32")
    assert Target.load(copy, [0, 1, 2], "float32") is kept
    assert Target.load(copy, [0, 1, 3], "float32") is not kept
    kept = Target.load(copy, [0, 1, 2], "float32")
    assert Target.load(copy, [0, 1, 2], "bfloat16") is not kept
    kept = Target.load(copy, [0, 1, 2], "float32")
    weights = next(p for p in copy.iterdir() if p.suffix == ".safetensors")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert Target.load(copy, [0, 1, 2], "float32") is not kept
