"""`eagle3-datagen status RUN_DIR`: per dataset and stage, samples expected / done / failed / stale / missing.

Invariant: the counts are reconciled across stages by sample id, each stage's expectation being what the stage
before it finished (tokens expects every done response, hidden states every tokens row that validation did not
fail), so "responses 80, tokens 3" shows as 77 missing tokens and a non-zero exit, never as two plain numbers.
Only completion markers and id/status columns are read: no token ids, no texts, no tensors; and while no marker,
the quarantine file or the settings asked about changed, not even those (`tasks.status.status_cache`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.common.config import scores_extracted_with
from tasks.common.failures import failure_class
from tasks.common.schemas import SCORES_STAGE, STAGES
from tasks.common.shards import PART_RE, Build, PartRef, PartState, input_fingerprints, part_state
from tasks.prepare.datasets import QUARANTINE
from tasks.status.status_cache import cached, status_key

FAILED_FILE = "failed_samples.jsonl"
"""Written into the run directory by `status`: one JSON line per failed or quarantined sample, with its reason."""

COLUMNS: dict[str, list[str]] = {
    "prompts": ["sample_id", "dataset"],
    "responses": ["sample_id", "dataset", "status", "failure_reason", "error"],
    "tokens": ["sample_id", "dataset"],
    "validation": ["sample_id", "dataset", "verdict", "reference_match", "structural_issues"],
    "hidden_states": ["sample_id", "dataset"],
    SCORES_STAGE: ["sample_id", "dataset"],
}
LABELS = {SCORES_STAGE: "scores"}
"""How a stage is shown: the target's scores live beside the hidden-state index (`hidden_states/_scores`)."""


def stage_label(stage: str) -> str:
    return LABELS.get(stage, stage)


@dataclass
class StageCount:
    """One dataset in one stage. done + failed + stale + missing = expected, and `extra` counts rows present
    that the stage before did not finish (left over from an older build)."""

    expected: int = 0
    done: int = 0
    failed: int = 0
    stale: int = 0
    missing: int = 0
    extra: int = 0
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    failed_by_class: dict[str, int] = field(default_factory=dict)


@dataclass
class StageParts:
    current: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)


@dataclass
class RunStatus:
    run_dir: Path
    stages: list[str]
    counts: dict[str, dict[str, StageCount]]
    """dataset -> stage -> counts."""
    parts: dict[str, StageParts]
    failed: list[dict[str, Any]]
    quarantined: list[dict[str, Any]]
    problems: list[str]

    @property
    def consistent(self) -> bool:
        """Every stage holds exactly what the stage before it finished, built from its current inputs."""
        return not self.problems

    def rows(self) -> list[dict[str, Any]]:
        """Table rows (one per dataset and stage) for the terminal and the Prefect table artifact."""
        out = []
        for dataset, stages in self.counts.items():
            for stage in self.stages:
                c = stages[stage]
                reasons = ", ".join(f"{r} {n}" for r, n in sorted(c.failed_by_reason.items()))
                out.append(
                    {
                        "dataset": dataset,
                        "stage": stage_label(stage),
                        "expected": c.expected,
                        "done": c.done,
                        "failed": c.failed,
                        "stale": c.stale,
                        "missing": c.missing,
                        "extra": c.extra,
                        "failed_by_reason": reasons,
                    }
                )
        return out

    def stored(self) -> dict[str, Any]:
        """Everything but the run directory and the quarantined rows (read from their file each time)."""
        return {
            "counts": {d: {s: asdict(c) for s, c in st.items()} for d, st in self.counts.items()},
            "parts": {s: asdict(p) for s, p in self.parts.items()},
            "failed": self.failed,
            "problems": self.problems,
        }

    @classmethod
    def restore(
        cls, run_dir: Path, stages: list[str], stored: Mapping[str, Any], quarantined: list[dict[str, Any]]
    ) -> RunStatus:
        counts = {d: {s: StageCount(**c) for s, c in st.items()} for d, st in stored["counts"].items()}
        parts = {s: StageParts(**p) for s, p in stored["parts"].items()}
        return cls(run_dir, stages, counts, parts, list(stored["failed"]), quarantined, list(stored["problems"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "consistent": self.consistent,
            "problems": self.problems,
            "counts": {d: {s: asdict(c) for s, c in st.items()} for d, st in self.counts.items()},
            "parts": {s: asdict(p) for s, p in self.parts.items()},
            "failed": len(self.failed),
            "quarantined": len(self.quarantined),
        }

    def markdown(self) -> str:
        head = "| dataset | stage | expected | done | failed | stale | missing | extra | failed by reason |"
        lines = [
            f"# status of `{self.run_dir}`",
            "",
            "**consistent**: every stage holds what the stage before finished."
            if self.consistent
            else "**stages disagree**:\n" + "\n".join(f"- {p}" for p in self.problems),
            "",
            head,
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.rows():
            lines.append(
                f"| {r['dataset']} | {r['stage']} | {r['expected']} | {r['done']} | {r['failed']} | {r['stale']} "
                f"| {r['missing']} | {r['extra']} | {r['failed_by_reason']} |"
            )
        if self.quarantined:
            lines += ["", f"{len(self.quarantined)} input rows quarantined (`prompts/{QUARANTINE}`)."]
        if self.failed:
            by_class = Counter(f["class"] for f in self.failed)
            lines += ["", f"{len(self.failed)} failed samples: " + ", ".join(f"{k} {v}" for k, v in by_class.items())]
        return "\n".join(lines)


def _part_numbers(run_dir: Path, stage: str) -> list[int]:
    """Parts present in a stage folder (finished or not)."""
    stage_dir = run_dir / stage
    if not stage_dir.is_dir():
        return []
    nums = {int(m.group(1)) for e in stage_dir.iterdir() if (m := PART_RE.match(e.name))}
    done_dir = stage_dir / "_done"
    if done_dir.is_dir():
        nums |= {int(e.stem.removeprefix("part-")) for e in done_dir.glob("part-*.json")}
    return sorted(nums)


def _stage_inputs(stage: str, skip_failed_validation: bool) -> tuple[str, ...] | None:
    if stage == "hidden_states" and not skip_failed_validation:
        return ("tokens",)
    return None


def _run_config(run_dir: Path) -> dict[str, Any]:
    summary = run_dir / "run_summary.json"
    if summary.is_file():
        try:
            config: dict[str, Any] = json.loads(summary.read_text()).get("config", {})
            return config
        except (OSError, ValueError):
            return {}
    return {}


def _read_ids(ref: PartRef, columns: list[str]) -> list[dict[str, Any]]:
    schema = pq.read_schema(ref.path)
    rows: list[dict[str, Any]] = pq.read_table(ref.path, columns=[c for c in columns if c in schema.names]).to_pylist()
    return rows


def _quarantine_bytes(run_dir: Path) -> bytes | None:
    path = run_dir / "prompts" / QUARANTINE
    return path.read_bytes() if path.is_file() else None


def _parse_quarantine(raw: bytes | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (raw or b"").decode("utf-8").splitlines() if line.strip()]


def _quarantined(run_dir: Path) -> list[dict[str, Any]]:
    return _parse_quarantine(_quarantine_bytes(run_dir))


def _validation_reason(row: Mapping[str, Any]) -> str:
    issues = row.get("structural_issues") or []
    if issues:
        return f"validation: {issues[0]}"
    return f"validation: {row.get('reference_match')}"


def run_status(
    run_dir: Path,
    recipes: Mapping[str, str | None] | None = None,
    extract_enabled: bool | None = None,
    skip_failed_validation: bool | None = None,
    scoring_enabled: bool | None = None,
) -> RunStatus:
    """Reconcile a run directory's stages. `recipes` (stage -> recipe digest) also marks parts built with another
    config stale; without it only changed input parts do. Extraction settings default to the run's last config
    (`run_summary.json`), else to "enabled, skipping samples validation failed"; scores (every hidden-states
    sample scored, `scores` after `hidden_states`) are expected when that config had scoring on (a run from
    before scoring existed has none to expect). The result of the last call is reused while its key (every
    marker's bytes, the quarantine file, these settings) is unchanged."""
    run_dir = Path(run_dir)
    config = _run_config(run_dir)
    extract_cfg = config.get("extract", {})
    if extract_enabled is None:
        extract_enabled = bool(extract_cfg.get("enabled", True))
    if skip_failed_validation is None:
        skip_failed_validation = bool(extract_cfg.get("skip_failed_validation", True))
    if scoring_enabled is None:
        scoring_enabled = "scoring" in config and scores_extracted_with(
            bool(config["scoring"].get("enabled", True)),
            str(extract_cfg.get("backend", "hf")),
            bool(extract_cfg.get("store_final_state", True)),
        )
    stages = [s for s in STAGES if s != "hidden_states" or extract_enabled]
    if extract_enabled and scoring_enabled:
        stages.append(SCORES_STAGE)
    recipes = recipes or {}
    numbers = {stage: _part_numbers(run_dir, stage) for stage in stages}
    raw_quarantine = _quarantine_bytes(run_dir)
    quarantined = _parse_quarantine(raw_quarantine)
    settings = {
        "stages": stages,
        "recipes": {s: recipes.get(s) for s in stages},
        "skip_failed_validation": skip_failed_validation,
    }
    key = status_key(run_dir, numbers, raw_quarantine, settings)

    def compute() -> dict[str, Any]:
        return _reconcile(run_dir, stages, numbers, recipes, skip_failed_validation, quarantined).stored()

    return RunStatus.restore(run_dir, stages, cached(run_dir, key, compute), quarantined)


def _reconcile(
    run_dir: Path,
    stages: list[str],
    numbers: Mapping[str, list[int]],
    recipes: Mapping[str, str | None],
    skip_failed_validation: bool,
    quarantined: list[dict[str, Any]],
) -> RunStatus:
    # Per stage: which parts are current, and the rows of the current and stale ones.
    parts: dict[str, StageParts] = {}
    present: dict[str, dict[str, dict[str, Any]]] = {}
    stale_ids: dict[str, set[str]] = {}
    for stage in stages:
        sp = parts[stage] = StageParts()
        present[stage] = {}
        stale_ids[stage] = set()
        for part in numbers[stage]:
            ref = PartRef(run_dir, stage, part)
            inputs = input_fingerprints(ref, _stage_inputs(stage, skip_failed_validation))
            state: PartState = part_state(ref, Build(inputs, recipes.get(stage)))
            if stage == "prompts" and state == "stale":
                state = "current"  # prompts parts are append-only: they have no inputs to go stale against
            getattr(sp, state).append(part)
            if state == "missing":
                continue
            rows = _read_ids(ref, COLUMNS[stage])
            if state == "current":
                present[stage].update({r["sample_id"]: r for r in rows})
            else:
                stale_ids[stage].update(r["sample_id"] for r in rows)

    datasets: dict[str, str] = {sid: r["dataset"] for sid, r in present["prompts"].items()}
    names = sorted(set(datasets.values()) | {q.get("dataset", "?") for q in quarantined})
    counts: dict[str, dict[str, StageCount]] = {d: {s: StageCount() for s in stages} for d in names}
    failed: list[dict[str, Any]] = []
    problems: list[str] = []

    expected: set[str] = set(datasets)
    for stage in stages:
        have = present[stage]
        done: set[str] = set()
        for sid in expected:
            c = counts[datasets[sid]][stage]
            c.expected += 1
            row = have.get(sid)
            if row is None:
                if sid in stale_ids[stage]:
                    c.stale += 1
                else:
                    c.missing += 1
                continue
            reason: str | None = None
            if stage == "responses" and row.get("status") != "done":
                reason = row.get("failure_reason") or "unknown"
                klass: str = failure_class(reason)
            elif stage == "validation" and row.get("verdict") == "fail":
                reason, klass = _validation_reason(row), "validation"
            if reason is None:
                c.done += 1
                done.add(sid)
                continue
            c.failed += 1
            c.failed_by_reason[reason] = c.failed_by_reason.get(reason, 0) + 1
            c.failed_by_class[klass] = c.failed_by_class.get(klass, 0) + 1
            failed.append(
                {
                    "sample_id": sid,
                    "dataset": datasets[sid],
                    "stage": stage,
                    "reason": reason,
                    "class": klass,
                    "error": row.get("error"),
                }
            )
        for sid in set(have) - expected:
            name = datasets.get(sid, have[sid]["dataset"])
            counts.setdefault(name, {s: StageCount() for s in stages})[stage].extra += 1
        # The next stage expects what this one finished: tokens the done responses, hidden states the rows
        # validation did not fail (all of them when extraction keeps failed samples).
        if stage == "validation" and not skip_failed_validation:
            done |= {f["sample_id"] for f in failed if f["stage"] == "validation"}
        expected = done

    for dataset, by_stage in counts.items():
        for stage, c in by_stage.items():
            what = []
            if c.stale:
                what.append(f"{c.stale} stale")
            if c.missing:
                what.append(f"{c.missing} missing")
            if c.extra:
                what.append(f"{c.extra} not expected")
            if what:
                problems.append(f"{dataset} {stage_label(stage)}: " + ", ".join(what) + f" of {c.expected} expected")
    for stage, sp in parts.items():
        label = stage_label(stage)
        if sp.stale:
            problems.append(f"{label}: stale parts {sp.stale} (built from inputs or a config that changed since)")
        if sp.missing and stage != "responses":
            problems.append(f"{label}: unfinished parts {sp.missing}")
    if not datasets:
        problems.append("no prepared samples: the prompts stage is empty")
    return RunStatus(run_dir, stages, counts, parts, failed, quarantined, problems)


def write_failed_file(status: RunStatus, path: Path | None = None) -> Path:
    """One JSON line per failed sample (stage, reason, class) and per quarantined input row (reason, raw row):
    the list a user fixes or feeds back. Written atomically; returns the path."""
    from tasks.common.shards import atomic_write_text

    path = path or status.run_dir / FAILED_FILE
    lines = [json.dumps(f, ensure_ascii=False, default=str) for f in status.failed]
    for q in status.quarantined:
        lines.append(json.dumps({"stage": "prepare", "class": "quarantined", **q}, ensure_ascii=False, default=str))
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path


def quarantine_notice(run_dir: Path) -> str | None:
    """One line announcing the quarantined input rows of a run directory (None when there are none): every
    command prints it, so a malformed row is never dropped silently."""
    rows = _quarantined(Path(run_dir))
    if not rows:
        return None
    per = Counter(str(r.get("dataset", "?")) for r in rows)
    where = Path(run_dir) / "prompts" / QUARANTINE
    return f"{len(rows)} input rows quarantined ({', '.join(f'{d} {n}' for d, n in sorted(per.items()))}): see {where}"


def failed_rate_violations(rows: list[dict[str, Any]], max_failed_rate: float) -> list[str]:
    """Datasets whose failed responses exceed `validation.max_failed_rate` (rows: `dataset_rows` of generate)."""
    out = []
    for row in rows:
        samples, failed = int(row.get("samples") or 0), int(row.get("failed") or 0)
        if samples and failed / samples > max_failed_rate:
            out.append(
                f"dataset {row['dataset']!r}: failed_rate {failed / samples:.4f} ({failed}/{samples} responses) > "
                f"max_failed_rate {max_failed_rate}"
            )
    return out
