"""What a tier did with store faults at rest (run/storefaults.py damaged its files between the prime and the
measure phase): detected and recomputed, served wrong, or failed the request, per config and fault."""

from __future__ import annotations

import pandas as pd

from kvscope.artifacts import Answer, StatusRow, StoreFaultPhase

DETECTIONS = ("kvscope:connector_corrupt_total", "kvscope:connector_io_errors_total")  # kvscope's connector
COLUMNS = ["config", "scenario", "fault", "files", "answers", "fail", "failed", "hits", "detected", "outcome"]


def outcome(files: int, answers: int, fail: int, failed: int, hits: int, detected: int | None,
            primes: int = 0, primes_failed: int = 0) -> str:
    """In words, from the measure phase: FAILs first (served wrong), then failures, then the tier's detections.
    A treatment whose prime requests all failed (a server down) stored nothing: not measured, whatever files an
    earlier treatment left to damage, unless an answer FAILs (a wrong answer is never left unsaid)."""
    if primes and primes_failed == primes and not fail:
        return f"not measured: every prime request failed ({primes_failed} of {primes}), this treatment stored nothing"
    if not files:
        return "not exercised: no file was damaged"
    if not answers:
        return "not exercised: no answer was recorded"
    if fail:
        return f"served wrong: {fail} of {answers} answers FAIL"
    if failed:
        return f"failed the request: {failed} of {answers}"
    if detected:
        return f"detected and recomputed: {detected} damaged blocks refused, every answer equals golden's"
    if detected is None:
        return (f"every answer equals golden's ({hits} cache hits); whether the tier read the damage is not "
                "observable (no detection counter)")
    return f"every answer equals golden's ({hits} cache hits), but the tier reported no damage: not exercised"


def table(status: list[StatusRow], scores: pd.DataFrame) -> pd.DataFrame:
    """One row per store-fault treatment: the fault, the files damaged, the measure phase's answers and what the
    tier did (`outcome`)."""
    rows = []
    for row in status:
        phase = row.phases.get("store-fault")
        if not isinstance(phase, StoreFaultPhase):
            continue
        mine = scores[(scores.config == row.config) & (scores.scenario == row.scenario)]
        sc, prime = mine[mine.phase == "measure"], mine[mine.phase == "prime"]
        delta = row.metrics_delta()
        detected = None if delta is None or not any(k in delta for k in DETECTIONS) else \
            int(sum(delta.get(k, 0.0) for k in DETECTIONS))
        counts = {"answers": len(sc), "fail": int((sc.cls == Answer.FAIL).sum()),
                  "failed": int((sc.cls == Answer.FAILED).sum()), "hits": int((sc.cached_tokens.fillna(0) > 0).sum())}
        rows.append({"config": row.config, "scenario": row.scenario, "fault": phase.fault, "files": phase.files,
                     **counts, "detected": detected,
                     "outcome": outcome(phase.files, detected=detected, **counts, primes=len(prime),
                                        primes_failed=int((prime.cls == Answer.FAILED).sum()))})
    return pd.DataFrame(rows, columns=COLUMNS)
