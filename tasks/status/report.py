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
from tasks.common.failures import FailureRecord, failure_class, rerun_action
from tasks.common.schemas import REPORTS_DIR, SCORES_STAGE, STAGES
from tasks.common.shards import PART_RE, Build, PartRef, PartState, input_fingerprints, part_state, reading_part
from tasks.common.state_inputs import hidden_states_inputs
from tasks.prepare.datasets import QUARANTINE
from tasks.status.status_cache import cached, status_key
from tasks.validate.failure_gates import rerun_may_pass

FAILED_FILE = "failed_samples.jsonl"
"""Written into the run directory by `status` and every run: one JSON line per failed sample and quarantined
input row, with the columns of `tasks.common.failures.FAILURE_COLUMNS` first."""

COLUMNS: dict[str, list[str]] = {
    "prompts": ["sample_id", "dataset"],
    "responses": ["sample_id", "dataset", "status", "failure_reason", "error", "attempts"],
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
    """`FailureRecord.to_dict()` of every failed sample (responses and validation)."""
    quarantined: list[dict[str, Any]]
    problems: list[str]
    retry_failed: str = "transient"
    gates_crossed: list[str] = field(default_factory=list)
    """The validation gates the current report (`reports/summary.json`) says were crossed: the last run stopped
    there, and a rerun with the same settings stops there again (each line says what to change)."""

    @property
    def consistent(self) -> bool:
        """Every stage holds exactly what the stage before it finished, built from its current inputs."""
        return not self.problems

    @property
    def blocking_gates(self) -> list[str]:
        """Crossed gates a rerun with the same settings stops at again (not those whose failures it retries)."""
        return [g for g in self.gates_crossed if not rerun_may_pass(g)]

    @property
    def rerun_completes(self) -> bool:
        """Whether rerunning with the same settings can bring the stages into agreement: no blocking gate."""
        return not self.blocking_gates

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
        cls,
        run_dir: Path,
        stages: list[str],
        stored: Mapping[str, Any],
        quarantined: list[dict[str, Any]],
        retry_failed: str,
    ) -> RunStatus:
        counts = {d: {s: StageCount(**c) for s, c in st.items()} for d, st in stored["counts"].items()}
        parts = {s: StageParts(**p) for s, p in stored["parts"].items()}
        failed, problems = list(stored["failed"]), list(stored["problems"])
        return cls(run_dir, stages, counts, parts, failed, quarantined, problems, retry_failed)

    def failure_records(self) -> list[dict[str, Any]]:
        """Failed samples, then quarantined input rows, each with `FAILURE_COLUMNS` first: what
        `failed_samples.jsonl`, `status` and the failed-samples artifact show."""
        rows = list(self.failed)
        for q in self.quarantined:
            record = FailureRecord(
                sample_id=None,
                dataset=str(q.get("dataset", "?")),
                stage="prepare",
                reason=str(q.get("reason", "")),
                failure_class="quarantined",
                attempts=None,
                last_error=None,
                rerun=rerun_action("prepare", "quarantined", ""),
            ).to_dict()
            extra = {k: v for k, v in q.items() if k not in record}
            rows.append({**record, **extra})
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "consistent": self.consistent,
            "problems": self.problems,
            "counts": {d: {s: asdict(c) for s, c in st.items()} for d, st in self.counts.items()},
            "parts": {s: asdict(p) for s, p in self.parts.items()},
            "failed": len(self.failed),
            "quarantined": len(self.quarantined),
            "gates_crossed": self.gates_crossed,
        }

    def _gate_lines(self) -> list[str]:
        lines = []
        retried = [g for g in self.gates_crossed if rerun_may_pass(g)]
        if retried:
            lines += ["**validation gates crossed** at the last report; a rerun retries these failed samples:"]
            lines += [*[f"- {g}" for g in retried], ""]
        if self.blocking_gates:
            lines += [
                "**validation gates crossed** at the last report; a rerun with the same settings stops here again:"
            ]
            lines += [*[f"- {g}" for g in self.blocking_gates], ""]
        return lines

    def markdown(self) -> str:
        head = "| dataset | stage | expected | done | failed | stale | missing | extra | failed by reason |"
        lines = [
            f"# status of `{self.run_dir}`",
            "",
            "**consistent**: every stage holds what the stage before finished."
            if self.consistent
            else "**stages disagree**:\n" + "\n".join(f"- {p}" for p in self.problems),
            "",
            *self._gate_lines(),
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
            lines += ["", f"{len(self.failed)} failed samples; what the next run does about them:", ""]
            lines += [f"- {line}" for line in rerun_summary(self.failed)]
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
    with reading_part(ref.path):
        schema = pq.read_schema(ref.path)
        names = [c for c in columns if c in schema.names]
        rows: list[dict[str, Any]] = pq.read_table(ref.path, columns=names).to_pylist()
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


def _failure(sid: str, dataset: str, stage: str, row: Mapping[str, Any], retry_failed: str) -> FailureRecord:
    """The record of one failed row of `responses` or `validation`."""
    klass: str
    if stage == "responses":
        reason = row.get("failure_reason") or "unknown"
        klass = failure_class(reason)
        attempts, error = row.get("attempts"), row.get("error")
    else:
        reason, klass = _validation_reason(row), "validation"
        attempts, error = None, "; ".join(row.get("structural_issues") or []) or str(row.get("reference_match"))
    return FailureRecord(
        sample_id=sid,
        dataset=dataset,
        stage=stage,
        reason=reason,
        failure_class=klass,
        attempts=attempts,
        last_error=error,
        rerun=rerun_action(stage, klass, reason, retry_failed),
    )


def display_cell(record: Mapping[str, Any], column: str) -> str:
    """One cell of a failure record as tables show it: `-` for none, a quarantined row named by file and row."""
    value = record.get(column)
    if column == "sample_id" and value is None:  # a quarantined input row never got an id
        return f"row {record.get('source_row', '?')} of {Path(str(record.get('source_file', '?'))).name}"
    return "-" if value is None else str(value)


def rerun_summary(failed: list[dict[str, Any]]) -> list[str]:
    """One sentence per (class, rerun action): how many failed samples the next run retries, and which it
    leaves as they are and why, e.g. `3 deterministic (context_length 3): never as sent: ...`."""
    groups: dict[tuple[str, str], Counter[str]] = {}
    for f in failed:
        groups.setdefault((f["class"], f["rerun"]), Counter())[f["reason"]] += 1
    lines = []
    for (klass, action), reasons in sorted(groups.items(), key=lambda kv: -sum(kv[1].values())):
        listed = ", ".join(f"{r} {n}" for r, n in reasons.most_common())
        lines.append(f"{sum(reasons.values())} {klass} ({listed}): {action}")
    return lines


def run_status(
    run_dir: Path,
    recipes: Mapping[str, str | None] | None = None,
    extract_enabled: bool | None = None,
    skip_failed_validation: bool | None = None,
    retry_failed: str | None = None,
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
    if retry_failed is None:
        retry_failed = str(config.get("endpoint", {}).get("retry_failed", "transient"))
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
        "retry_failed": retry_failed,
    }
    key = status_key(run_dir, numbers, raw_quarantine, settings)

    def compute() -> dict[str, Any]:
        status = _reconcile(run_dir, stages, numbers, recipes, skip_failed_validation, quarantined, retry_failed)
        return status.stored()

    status = RunStatus.restore(run_dir, stages, cached(run_dir, key, compute), quarantined, retry_failed)
    status.gates_crossed = _gates_crossed(run_dir, numbers.get("validation", []))
    return status


def _gates_crossed(run_dir: Path, validation_parts: list[int]) -> list[str]:
    """The crossed gates of `reports/summary.json`, when it is at least as new as every validation marker (a
    report older than a rebuilt validation part is not about these samples)."""
    report = run_dir / REPORTS_DIR / "summary.json"
    try:
        written = report.stat().st_mtime
        crossed = json.loads(report.read_text()).get("gates_crossed") or []
    except (OSError, ValueError, AttributeError):
        return []
    for part in validation_parts:
        marker = PartRef(run_dir, "validation", part).marker
        if marker.is_file() and marker.stat().st_mtime > written:
            return []
    return [str(g) for g in crossed]


def _reconcile(
    run_dir: Path,
    stages: list[str],
    numbers: Mapping[str, list[int]],
    recipes: Mapping[str, str | None],
    skip_failed_validation: bool,
    quarantined: list[dict[str, Any]],
    retry_failed: str,
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
            inputs = (
                hidden_states_inputs(ref, skip_failed_validation)
                if stage == "hidden_states"
                else input_fingerprints(ref)
            )
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
            failing = (stage == "responses" and row.get("status") != "done") or (
                stage == "validation" and row.get("verdict") == "fail"
            )
            if not failing:
                c.done += 1
                if not (stage == "validation" and skip_failed_validation and row.get("verdict") == "drop"):
                    done.add(sid)  # extraction skips a dropped row with the failed ones (`failed_validation_ids`)
                continue
            record = _failure(sid, datasets[sid], stage, row, retry_failed)
            c.failed += 1
            c.failed_by_reason[record.reason] = c.failed_by_reason.get(record.reason, 0) + 1
            c.failed_by_class[record.failure_class] = c.failed_by_class.get(record.failure_class, 0) + 1
            failed.append(record.to_dict())
        for sid in set(have) - expected:
            name = datasets.get(sid, have[sid]["dataset"])
            counts.setdefault(name, {s: StageCount() for s in stages})[stage].extra += 1
        # The next stage expects what this one finished: tokens the done responses, hidden states the rows
        # validation did not fail nor drop (all of them when extraction keeps failed samples).
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
    return RunStatus(run_dir, stages, counts, parts, failed, quarantined, problems, retry_failed)


def write_failed_file(status: RunStatus, path: Path | None = None) -> Path:
    """One JSON line per failed sample and per quarantined input row (`FAILURE_COLUMNS`, then a quarantined
    row's source file, row and raw text): the list a user fixes or feeds back. Written atomically."""
    from tasks.common.shards import atomic_write_text

    path = path or status.run_dir / FAILED_FILE
    lines = [json.dumps(f, ensure_ascii=False, default=str) for f in status.failure_records()]
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
