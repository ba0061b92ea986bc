"""Runs side by side (two connector versions, two machines): each config's verdict, hit TTFT and speed-up
per run, the change from the first run, and a plot of the speed-ups with their intervals; for a normal and
an exact run of one workload, what the exact mode costs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvscope import files
from kvscope.analyze import html, plots
from kvscope.analyze.loaded import RunError, load
from kvscope.analyze.overview import answered, columns, throughput, tpot
from kvscope.analyze.report import Analysis, _md_table, analyze
from kvscope.artifacts import RunInfo


def _analyses(folders: list[Path]) -> list[Analysis]:
    runs = [load(f) for f in folders]
    digests = {str(f): r.workload_digest for f, r in zip(folders, runs)}
    if len(set(digests.values())) != 1:
        raise RunError(f"runs replayed different workloads (digests {digests}); comparing them would mislead")
    return [analyze(r) for r in runs]


def table(folders: list[Path]) -> pd.DataFrame:
    """One row per config and run, from each run's overview; `*_change` against the first run."""
    return _table(_analyses(folders))


def _table(analyses: list[Analysis]) -> pd.DataFrame:
    frames = []
    for a in analyses:
        ov = a.overview.copy()
        ov.insert(0, "run", a.loaded.run.run_id)
        ov.insert(1, "vllm", a.loaded.run.servers[0].manifest.vllm_version)
        frames.append(ov)
    both = pd.concat(frames, ignore_index=True)
    first = frames[0].set_index("config")
    for col in ("hit_ttft_p50_ms", "speedup_hits"):
        base = both.config.map(first[col]) if len(first) else None
        both[f"{col}_change"] = ((both[col] - base) / base).round(3) if base is not None else None
    return both


def mode_cost(folders: list[Path]) -> pd.DataFrame | None:
    """What batch-invariant serving costs, from a normal and an exact run of one workload (same servers' flags
    otherwise): per config both served, TTFT p50, TPOT p50 and output tokens/s of the measured requests in
    each mode, and the exact run's change (0.25 = 25 % more); None unless the runs are one of each mode."""
    return _mode_cost(_analyses(folders))


def _mode_cost(analyses: list[Analysis]) -> pd.DataFrame | None:
    by_mode = {a.loaded.run.mode: a for a in analyses}
    if len(analyses) != 2 or set(by_mode) != {"normal", "exact"}:
        return None
    both = [c for c in by_mode["normal"].verdicts.config if c in set(by_mode["exact"].verdicts.config)]
    rows = []
    for config in both:
        raw: dict[str, float | None] = {}
        for mode, a in by_mode.items():
            done = answered(a.loaded.recs, config)
            ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
            tpots = [t for r in done if (t := tpot(r)) is not None]
            raw[f"ttft_p50_ms_{mode}"] = float(np.median(ttfts)) * 1000 if ttfts else None
            raw[f"tpot_p50_ms_{mode}"] = float(np.median(tpots)) * 1000 if tpots else None
            raw[f"tokens_per_s_{mode}"] = throughput(columns(a.loaded.recs, config))[1]
        row: dict = {"config": config, **{k: round(v, 2) if v is not None else None for k, v in raw.items()}}
        for col in ("ttft_p50_ms", "tpot_p50_ms", "tokens_per_s"):
            normal, exact = raw[f"{col}_normal"], raw[f"{col}_exact"]
            row[f"{col.removesuffix('_ms')}_change"] = round(exact / normal - 1, 3) if normal and exact else None
        rows.append(row)
    return pd.DataFrame(rows)


def plot(frame: pd.DataFrame, path: Path) -> str:
    """Speed-up on hits per candidate config, one marker per run, with the 95 % interval."""
    plt = plots.pyplot()
    rows = frame[frame.speedup_hits.notna() & (frame.role == "candidate")]
    configs = list(dict.fromkeys(rows.config))
    runs = list(dict.fromkeys(frame.run))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(configs) + 1.5))
    for k, run in enumerate(runs):
        part = rows[rows.run == run]
        y = [configs.index(c) + (k - (len(runs) - 1) / 2) * 0.25 for c in part.config]
        point = part.speedup_hits.to_numpy(float)
        low, high = np.array([[float(x) for x in ci.split("–")] for ci in part.speedup_ci95]).reshape(-1, 2).T
        ax.errorbar(point, np.array(y), xerr=np.vstack([point - low, high - point]), fmt="o", capsize=3, label=run)
    ax.axvline(1, color="0.5", lw=1, ls="--")
    ax.invert_yaxis()
    ax.set_yticks(range(len(configs)), configs, fontsize=8)
    ax.set(xlabel="speed-up on cache hits (golden / config), 95 % interval", title="Speed-up per run")
    ax.legend(fontsize=7)
    return plots.save(fig, path)


def machine_warning(runs: list[RunInfo]) -> str:
    """A sentence when the runs come from different machines or modes (a change in speed may be the machine's,
    and an exact run has no speed); "" when they do not."""
    machines = {(r.machine.cpu, r.machine.cores, r.machine.gpu) for r in runs}
    words = []
    if len(machines) > 1:
        words.append("**These runs come from different machines** (" + "; ".join(
            f"`{r.run_id}`: {r.machine.cpu}, {r.machine.cores} cores, GPU {r.machine.gpu or 'none'}" for r in runs)
            + "): a change in speed may be the machine's, not the tier's.")
    if len({r.mode for r in runs}) > 1:
        words.append("**The runs served in different modes** (" + ", ".join(f"`{r.run_id}` {r.mode}" for r in runs)
                     + "): an exact-mode run gives no speed-ups" + ("; what the mode costs is below." if len(runs) == 2
                                                                   else "; compare one run of each for its cost."))
    return " ".join(words)


def write(folders: list[Path], out: Path | None = None) -> str:
    """The comparison as markdown; with `out`, a folder with comparison.md, comparison.html and its plot."""
    analyses = _analyses(folders)
    frame = _table(analyses)
    warning = machine_warning([a.loaded.run for a in analyses])
    cost = _mode_cost(analyses)
    cols = ["config", "run", "vllm", "verdict", "hits", "hit_ttft_p50_ms", "hit_ttft_p50_ms_change", "speedup_hits",
            "speedup_ci95", "speedup_hits_change", "hit_rate", "advice"]
    order = {c: i for i, c in enumerate(dict.fromkeys(frame.config))}
    rows = frame.iloc[frame.config.map(order).argsort(kind="stable")][cols]
    text = ("# kvscope comparison\n\nRuns: " + ", ".join(f"`{f}`" for f in folders) + ". `*_change`: relative "
            "to the first run (-0.2 = 20 % lower).\n\n" + (warning + "\n\n" if warning else "") + _md_table(rows)
            + "\n")
    if cost is not None:
        text += ("\n## The exact mode's cost\n\nThe same workload served normally and batch-invariant: TTFT "
                 "p50, TPOT p50 and output tokens/s of every measured request; `*_change`: exact against normal "
                 "(0.25 = 25 % more).\n\n" + _md_table(cost) + "\n")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        png = plot(frame, out / "speedup.png")
        text += f"\n![Speed-up per run]({png})\n"
        files.replace(out / "comparison.md", text)
        files.replace(out / "comparison.html", html.render(text, "kvscope comparison",
                                                           {png: files.read_bytes(out / png)}))
    return text
