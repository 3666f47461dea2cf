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


def test_batched_decodes_equal_one_by_one_decodes(tiny_model_dir: Path) -> None:
    """Prompts of different lengths (left padding) and an answer that ends early: the batch gives each prompt
    the ids its own decode gives, cut after the end token as a lone decode stops there."""
    prompts = [[1, 5, 9, 13], [1, 7, 7], [2, 3, 4, 5, 6, 7, 8, 9], [3, 3]]  # batched by length: 2+3, 4+8
    alone = Target.load(tiny_model_dir, [0, 1, 2], "float32")
    unended = alone.greedy(prompts[2], 8)
    stop = unended[len(prompts[2]) + 2]  # the third token it generates becomes the end token
    alone.model.generation_config.eos_token_id = stop
    expected = [alone._decode(p, 8) for p in prompts]
    assert expected[2] == unended[: unended.index(stop, len(prompts[2])) + 1]

    batched = Target.load(tiny_model_dir, [0, 1, 2], "float32")
    batched.model.generation_config.eos_token_id = stop
    assert batched.decode_all(prompts, 8, batch_size=2) == {"batched": 4, "redecoded": 0}
    assert [batched.greedy(p, 8) for p in prompts] == expected
    assert batched.decode_all(prompts, 8) == {"batched": 0, "redecoded": 0}  # kept, not decoded again


def test_a_batched_decode_the_target_would_not_choose_is_decoded_again(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A near-tie flipped by padding is stood in for by a batch that returns a wrong token for one prompt: the
    check against the target's forward pass over that sequence alone sends it to a lone decode."""
    prompts = [[1, 5, 9, 13], [1, 7, 7]]
    target = Target.load(tiny_model_dir, [0, 1, 2], "float32")
    expected = [target._decode(p, 6) for p in prompts]
    real_batch = Target._decode_batch

    def flipping(self: Target, chunk: Any, max_new_tokens: int) -> list[list[int]]:
        decoded = real_batch(self, chunk, max_new_tokens)
        wrong = decoded[1][len(chunk[1]) + 3]
        decoded[1][len(chunk[1]) + 3] = (wrong + 1) % int(self.model.config.vocab_size)
        return decoded

    monkeypatch.setattr(Target, "_decode_batch", flipping)
    assert target.decode_all(prompts, 6) == {"batched": 1, "redecoded": 1}
    assert [target.greedy(p, 6) for p in prompts] == expected
