"""The validation split of an export: whole prompts, chosen by a hash of the prompt id, never by file order.

Several samples can share a prompt (`sampling.samples_per_prompt`; a conversation regenerated turn by turn is
one sample); a drafter evaluated on a held-out sample whose prompt it trained on would be measured on its
training data. So the unit
of the split is the prompt: `prompt_id` from the run's `prompts` parts, joined by sample_id. A sample whose
prompt row is missing (a run directory without its `prompts` stage) is its own group, and the manifest says
which grouping was used. Membership is a pure function of (prompt id, fraction, seed): it does not change when
parts are added, reordered or re-exported.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from tasks.common.shards import done_parts, read_part
from tasks.export.errors import ExportError

PROMPTS_STAGE = "prompts"
HASH_SPACE = 2**64


def prompt_ids(run_dir: Path) -> dict[str, str]:
    """sample_id -> prompt_id over every finished prompts part of the run (empty when it has none)."""
    out: dict[str, str] = {}
    for ref in done_parts(Path(run_dir), PROMPTS_STAGE):
        columns = read_part(ref, columns=["sample_id", "prompt_id"]).to_pydict()
        out.update(zip(columns["sample_id"], columns["prompt_id"], strict=True))
    return out


def in_validation(prompt_id: str, fraction: float, seed: int = 0) -> bool:
    """Whether this prompt's samples are held out: the first 8 bytes of sha256(seed/prompt_id), as a fraction of
    2^64, fall below `fraction`."""
    if not 0.0 <= fraction < 1.0:
        raise ExportError(f"validation fraction must be in [0, 1), got {fraction}")
    digest = hashlib.sha256(f"{seed}/{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * HASH_SPACE


def train_ratio(n_train: int, n_total: int) -> float:
    """The `train_data_ratio` for which speculators' `ArrowDataset` puts exactly the first `n_train` rows in its
    train split (`split_idx = int(len * ratio)`): n_train / n_total, nudged up where float rounding truncates."""
    if n_total == 0 or n_train == n_total:
        return 1.0
    if n_train == 0:
        raise ExportError(f"all {n_total} samples fell in the validation split; lower the validation fraction")
    ratio = n_train / n_total
    while int(n_total * ratio) < n_train:
        ratio = math.nextafter(ratio, 1.0)
    if int(n_total * ratio) != n_train:
        raise ExportError(f"no float ratio splits {n_total} rows after row {n_train}")
    return ratio
