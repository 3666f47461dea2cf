"""Per-sample bounds on the target's scores, and what the exports do with a sample outside them.

A sample is out of bounds for each bound it crosses (`scoring.*`, each off when None), named by a reason code:

| reason | bound | what it catches |
|---|---|---|
| `high_nll` | mean NLL > `max_mean_nll_nats` | text the target would not produce (garbage, another model's style) |
| `low_top1` | top-1 rate < `min_top1_rate` | answers sampled far from the target's choices |
| `low_prob_run` | longest run below `low_prob_floor` > `max_low_prob_run_tokens` | a stretch of garbage in an answer |
| `unlikely_end` | end-token log-probability < `min_end_logprob` | an answer that stops where the target would not |

`scoring.sample_policy` decides what the exports do with such samples: `keep` (only counted), `flag` (kept and
listed, with their reasons, in the export manifest), `drop` (left out). The report counts them by reason either
way. The bounds are applied when read, so changing one never rescores anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.common.config import ScoringConfig

REASONS = ("high_nll", "low_top1", "low_prob_run", "unlikely_end")


def out_of_bounds(row: Mapping[str, Any], scfg: ScoringConfig) -> list[str]:
    """The reason codes of the bounds a scores row crosses (none for a sample without scored tokens)."""
    if not row.get("scored_tokens"):
        return []
    reasons = []
    nll, top1, run, end = row["mean_nll"], row["top1_rate"], row["longest_low_prob_run"], row["end_logprob"]
    if scfg.max_mean_nll_nats is not None and nll is not None and nll > scfg.max_mean_nll_nats:
        reasons.append("high_nll")
    if scfg.min_top1_rate is not None and top1 is not None and top1 < scfg.min_top1_rate:
        reasons.append("low_top1")
    if scfg.max_low_prob_run_tokens is not None and run > scfg.max_low_prob_run_tokens:
        reasons.append("low_prob_run")
    if scfg.min_end_logprob is not None and end is not None and end < scfg.min_end_logprob:
        reasons.append("unlikely_end")
    return reasons


def recorded_scoring(run_dir: Path) -> ScoringConfig:
    """The scoring settings of the run's last pipeline run (`run_summary.json`); defaults when it has none."""
    try:
        config = json.loads((Path(run_dir) / "run_summary.json").read_text()).get("config", {})
    except (OSError, ValueError):
        return ScoringConfig()
    section = config.get("scoring") if isinstance(config, dict) else None
    return ScoringConfig.model_validate(section) if isinstance(section, dict) else ScoringConfig()


def sample_reasons(run_dir: Path, parts: list[int], scfg: ScoringConfig) -> tuple[dict[str, list[str]], list[int]]:
    """(sample_id -> the bounds it crosses, for samples crossing any; the parts with no current scores), over
    the given hidden-states parts. A scores part counts only when built from the index part now in place."""
    from tasks.common.schemas import SCORES_STAGE
    from tasks.common.shards import PartRef, fingerprint, read_marker, read_part

    reasons: dict[str, list[str]] = {}
    unscored = []
    columns = ["sample_id", "scored_tokens", "mean_nll", "top1_rate", "longest_low_prob_run", "end_logprob"]
    for part in parts:
        ref = PartRef(Path(run_dir), SCORES_STAGE, part)
        index = fingerprint(PartRef(Path(run_dir), "hidden_states", part))
        if not ref.is_done() or read_marker(ref).get("inputs") != {"hidden_states": index}:
            unscored.append(part)
            continue
        for row in read_part(ref, columns=columns).to_pylist():
            crossed = out_of_bounds(row, scfg)
            if crossed:
                reasons[row["sample_id"]] = crossed
    return reasons, unscored
