"""`fused_loss_compilable`: the backward autotuner of speculators' fused loss gets its own copies of the lists it
shares with the forward one (the GPU failure it prevents is described in `tasks.train.fused_loss`; the real
kernels need Triton, so `tests/test_train.py` on a GPU is where the trainer runs through it)."""

from __future__ import annotations

from types import SimpleNamespace

from tasks.train.fused_loss import fused_loss_compilable, shared_containers


class Autotuner:
    """The shape of Triton's `Autotuner` that matters here: attributes set from one decorator's arguments."""

    def __init__(self, configs: list[str], key: list[str], prune: dict[str, object], fn: str) -> None:
        self.configs, self.keys, self.prune_configs_by, self.fn = configs, key, prune, fn
        self.cache: dict[tuple[int, ...], str] = {}


def kernels() -> SimpleNamespace:
    configs, key, prune = ["tile-1024", "tile-2048"], ["n_cols", "OP"], {"early_config_prune": len}
    return SimpleNamespace(
        loss_forward_kernel=Autotuner(configs, key, prune, "forward"),
        loss_backward_kernel=Autotuner(configs, key, prune, "backward"),
    )


def test_shared_lists_and_dicts_are_copied_for_the_call_and_restored() -> None:
    fused = kernels()
    forward, backward = fused.loss_forward_kernel, fused.loss_backward_kernel
    before = {name: getattr(backward, name) for name in ("configs", "keys", "prune_configs_by", "cache")}
    assert shared_containers(forward, backward) == ["configs", "keys", "prune_configs_by"]
    with fused_loss_compilable(fused) as unshared:
        assert unshared == ["configs", "keys", "prune_configs_by"]
        assert shared_containers(forward, backward) == []
        assert backward.configs == forward.configs and backward.keys == forward.keys
        assert backward.prune_configs_by == forward.prune_configs_by
        assert backward.cache is before["cache"]  # its own already: untouched
    for name, value in before.items():
        assert getattr(backward, name) is value


def test_nothing_changes_where_nothing_is_shared_or_there_is_no_fused_loss() -> None:
    separate = SimpleNamespace(
        loss_forward_kernel=Autotuner(["a"], ["k"], {}, "forward"),
        loss_backward_kernel=Autotuner(["a"], ["k"], {}, "backward"),
    )
    with fused_loss_compilable(separate) as unshared:
        assert unshared == []
    with fused_loss_compilable(SimpleNamespace()) as unshared:
        assert unshared == []
