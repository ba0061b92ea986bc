"""The report's plots, each with a caption saying what to look for.

Roles are styled apart everywhere: golden black, the control grey and dashed, candidates in colour,
canaries thin and dotted (they are broken on purpose).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd

from kvscope import files
from kvscope.artifacts import Answer
from kvscope.runfolder import RunFolder

FIDELITY_COLOURS = {"ok": "#4daf4a", Answer.FAIL: "#e41a1c", "partly unscored": "#ffbf00", "no data": "#bdbdbd",
                    "golden missing": "#bdbdbd"}


def drawn_alike(a: bytes, b: bytes) -> bool:
    """Whether two PNGs draw one plot: the same size, and every pixel of each found in the other at most one
    pixel away. numpy's log10 differs in the last bit with and without AVX-512, which moves a log axis's edge
    by a pixel between CPUs; a changed value, line or label moves more, or adds colours."""
    if a == b:
        return True
    from PIL import Image  # matplotlib's own dependency

    try:
        for png in (a, b):
            Image.open(io.BytesIO(png)).verify()  # every chunk whole, to the end
        x, y = (np.asarray(Image.open(io.BytesIO(png)).convert("RGBA")) for png in (a, b))
    except (OSError, SyntaxError, ValueError):  # what PIL raises for a file that is not a whole PNG
        return False
    return x.shape == y.shape and _within_a_pixel(x, y) and _within_a_pixel(y, x)


def _within_a_pixel(x: np.ndarray, y: np.ndarray) -> bool:
    h, w = x.shape[:2]
    padded = np.pad(y, ((1, 1), (1, 1), (0, 0)), mode="edge")
    found = np.zeros((h, w), dtype=bool)
    for dy in range(3):
        for dx in range(3):
            found |= (x == padded[dy:dy + h, dx:dx + w]).all(axis=-1)
    return bool(found.all())


def _style(role: str, colour) -> dict:
    return {"golden": dict(color="black", lw=2.2), "control": dict(color="0.55", lw=1.6, ls="--"),
            "canary": dict(color=colour, lw=0.8, ls=":", alpha=0.6)}.get(role, dict(color=colour, lw=1.6))


def _plain_log_labels(axis) -> None:
    """A log axis labelled 100, 200, 500 rather than 10^2 and crowded minor labels."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on a bench host)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> str:
    """Draw FIG into PATH as a PNG, whole or not at all (files.replace: a link at PATH is replaced, not followed)."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    pyplot().close(fig)
    files.replace(path, png.getvalue())
    return path.name


def ttft_by_scenario(plt, folder: Path, roles: dict[str, str], recs: dict, scenarios: list[str]) -> str:
    """TTFT CDFs per scenario: golden on every request, each other config on its cache hits."""
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.6), squeeze=False, sharey=True)
    colours = plt.get_cmap("tab10")
    for ax, scenario in zip(axes[0], scenarios):
        for i, (config, role) in enumerate(roles.items()):
            ttft = sorted(r.ttft_s * 1000 for r in recs.get((config, scenario), []) if r.ok and r.phase == "measure"
                          and r.ttft_s and (role in ("golden", "control") or r.cached_tokens))
            if ttft:
                label = config if role != "golden" else f"{config} (golden, all)"
                ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=label, marker="o" if len(ttft) < 5 else
                        None, ms=4, **_style(role, colours(i % 10)))
        ax.set(xscale="log", xlabel="TTFT (ms, log)", title=scenario)
        _plain_log_labels(ax.xaxis)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("share of requests")
    if axes[0][-1].get_legend_handles_labels()[0]:  # a run whose every request failed plots nothing
        axes[0][-1].legend(fontsize=7, loc="lower right")
    return save(fig, RunFolder(folder).plot("ttft_cdf"))


def ttft_vs_cached(plt, folder: Path, roles: dict[str, str], recs: dict) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = plt.get_cmap("tab10")
    for i, (config, role) in enumerate(roles.items()):
        pts = [((r.cached_tokens or 0) / r.prompt_tokens, r.ttft_s * 1000) for (c, _), rs in recs.items()
               if c == config for r in rs if r.ok and r.prompt_tokens and r.ttft_s and r.phase == "measure"]
        if pts and role != "canary":
            share, ms = zip(*pts)
            style = _style(role, colours(i % 10))
            ax.scatter(share, ms, s=10 if role == "candidate" else 6, alpha=0.7, color=style["color"], label=config)
    ax.set(yscale="log", xlabel="cached share of prompt tokens", ylabel="TTFT (ms, log)",
           title="TTFT against the cached share of the prompt")
    _plain_log_labels(ax.yaxis)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return save(fig, RunFolder(folder).plot("ttft_vs_cached"))


def _grid(plt, rows: list[str], cols: list[str]):
    return plt.subplots(figsize=(1.9 * len(cols) + 2.2, 0.42 * len(rows) + 1.4))


def hit_rate_heatmap(plt, folder: Path, roles: dict[str, str], summary: pd.DataFrame, scenarios: list[str]) -> str:
    configs = [c for c in roles if roles[c] not in ("golden", "control")]
    grid = np.full((len(configs), len(scenarios)), np.nan)
    fig, ax = _grid(plt, configs, scenarios)
    for r in summary.itertuples():
        if r.config in configs:
            i, j = configs.index(r.config), scenarios.index(r.scenario)
            grid[i, j] = np.nan if pd.isna(r.hit_rate_per_request) else r.hit_rate_per_request  # None: no answer
            theory = "–" if pd.isna(r.hit_rate_theoretical) else f"{r.hit_rate_theoretical:.2f}"
            measured = "–" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}"
            ax.text(j, i, f"{measured} (LRU {theory})", ha="center", va="center", fontsize=7)
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=1, aspect="auto", alpha=0.8)
    ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8)
    ax.set_yticks(range(len(configs)), configs, fontsize=8)
    ax.set_title("Token hit rate, measured (LRU: what an ideal cache of that size would hit)", fontsize=9)
    return save(fig, RunFolder(folder).plot("hit_rates"))


def fidelity_heatmap(plt, folder: Path, roles: dict[str, str], summary: pd.DataFrame, scenarios: list[str]) -> str:
    from matplotlib.colors import ListedColormap

    configs = list(roles)
    classes = list(FIDELITY_COLOURS)
    grid = np.full((len(configs), len(scenarios)), classes.index("no data"))
    fig, ax = _grid(plt, configs, scenarios)
    for r in summary.itertuples():
        i, j = configs.index(r.config), scenarios.index(r.scenario)
        grid[i, j] = classes.index(r.fidelity)
        scored = r.identical_hit + r.benign_hit + r.fail_hit + r.identical_miss + r.benign_miss + r.fail_miss
        label = f"{Answer.FAIL} {r.fail_hit + r.fail_miss}/{scored}" if r.fidelity == Answer.FAIL else (
            f"{r.fidelity} {scored}" if scored else r.fidelity)
        ax.text(j, i, label, ha="center", va="center", fontsize=7)
    ax.imshow(grid, cmap=ListedColormap(list(FIDELITY_COLOURS.values())), vmin=-0.5, vmax=len(classes) - 0.5,
              aspect="auto")
    ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8)
    ax.set_yticks(range(len(configs)), [f"{c} ({roles[c]})" for c in configs], fontsize=8)
    ax.set_title("Fidelity against golden: green every scored answer within tolerance, red any FAIL", fontsize=9)
    return save(fig, RunFolder(folder).plot("fidelity_matrix"))


def load_sweep(plt, folder: Path, table: pd.DataFrame) -> str:
    """TTFT p50 against throughput at each load, one line per config (canaries left out)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = plt.get_cmap("tab10")
    for i, (config, part) in enumerate(table[table.role != "canary"].groupby("config", sort=False)):
        part = part.dropna(subset=["requests_per_s", "ttft_p50_ms"])
        ax.plot(part.requests_per_s, part.ttft_p50_ms, marker="o", label=config,
                **_style(part.role.iloc[0] if len(part) else "candidate", colours(i % 10)))
        for r in part.itertuples():
            ax.annotate(f"{r.users}", (r.requests_per_s, r.ttft_p50_ms), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set(yscale="log", xlabel="throughput (requests/s)", ylabel="TTFT p50 (ms, log)",
           title="Load sweep: TTFT against throughput (labels: concurrent users)")
    _plain_log_labels(ax.yaxis)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return save(fig, RunFolder(folder).plot("load_sweep"))


CAPTIONS = {
    "fidelity_matrix.png": "Which config × scenario served a wrong answer: a candidate's red cell is a cache that "
                           "changed answers; every canary row should be red.",
    "hit_rates.png": "Measured token hit rate against an ideal LRU of the same capacity: a cell far below its LRU "
                     "value is a tier that loses or fails to find blocks.",
    "ttft_cdf.png": "TTFT of cache hits against golden's (black) per scenario: curves left of golden are faster; "
                    "canaries (dotted) are broken on purpose.",
    "ttft_vs_cached.png": "TTFT against how much of the prompt came from cache: a tier that pays off slopes down.",
    "load_sweep.png": "Each config's TTFT as the load rises: where a tier's curve bends up sooner than golden's, it "
                      "stops paying off under load.",
}


def draw(folder: Path, roles: dict[str, str], summary: pd.DataFrame, recs: dict,
         sweep: pd.DataFrame | None = None) -> list[tuple[str, str]]:
    """Every plot of a report, as (file name, caption)."""
    plt = pyplot()
    scenarios = list(dict.fromkeys(summary.scenario))
    made = [fidelity_heatmap(plt, folder, roles, summary, scenarios),
            hit_rate_heatmap(plt, folder, roles, summary, scenarios),
            ttft_by_scenario(plt, folder, roles, recs, scenarios),
            ttft_vs_cached(plt, folder, roles, recs)]
    if sweep is not None and len(sweep):
        made.append(load_sweep(plt, folder, sweep))
    return [(name, CAPTIONS[name]) for name in made]
