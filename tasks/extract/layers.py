"""Which decoder layers an EAGLE-3 drafter reads, and the one indexing convention every backend follows.

Convention: the captured output of layer id k (0-based) is the residual stream leaving decoder layer k, which
is HF `output_hidden_states[k + 1]` (index 0 is the embedding output). The "final" state is the *input* of the
model's final norm (the raw output of layer N - 1; `storage.FINAL_STATE`), from which the lm_head's input is one
norm away. In transformers 5.x `output_hidden_states[-1]` is the post-norm state (it replaces the raw output of
the last layer), so `[k + 1]` is only the raw layer-k output for k <= N - 2. Layer N - 1 is therefore not a
valid auxiliary layer: its raw output is the final state the drafter already receives. `tests/test_extract.py`
checks both halves of this against a real forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from tasks.common.errors import ConfigError

AUX_LAYER_COUNT = 3
MIN_LAYERS = 7


class LayerSelectionError(ConfigError):
    """The configured auxiliary layers do not fit the target model."""

    def __init__(self, layers: Sequence[int], num_layers: int, reason: str) -> None:
        super().__init__(f"extract.layers {list(layers)} invalid for a {num_layers}-layer model: {reason}")
        self.layers = list(layers)
        self.num_layers = num_layers


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high choice: [1, N//2 - 1, N - 4]; N >= 7 keeps the three distinct and increasing."""
    if num_layers < MIN_LAYERS:
        raise LayerSelectionError([], num_layers, f"the default needs at least {MIN_LAYERS} decoder layers")
    return [1, num_layers // 2 - 1, num_layers - 4]


def validate_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Exactly three distinct ids, strictly increasing (the aux tensor is concatenated in this order),
    each in [0, N - 2] (see the module docstring for why N - 1 is excluded)."""
    chosen = list(layers)
    if len(chosen) != AUX_LAYER_COUNT:
        raise LayerSelectionError(chosen, num_layers, f"expected {AUX_LAYER_COUNT} layer ids, got {len(chosen)}")
    out_of_range = [k for k in chosen if not 0 <= k <= num_layers - 2]
    if out_of_range:
        raise LayerSelectionError(chosen, num_layers, f"ids {out_of_range} are outside [0, {num_layers - 2}]")
    if len(set(chosen)) != len(chosen):
        raise LayerSelectionError(chosen, num_layers, "ids must be distinct")
    if chosen != sorted(chosen):
        raise LayerSelectionError(chosen, num_layers, "ids must be sorted low, mid, high")
    return chosen


def resolve_layers(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    return validate_layers(default_aux_layers(num_layers) if configured is None else configured, num_layers)
