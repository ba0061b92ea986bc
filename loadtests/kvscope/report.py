"""Reports are functions of a run folder's raw records: report.md, CSV tables and PNG plots.

`make report RUN=...` re-runs this with no server. Every number comes from records/*.jsonl, run.json and
status.jsonl; nothing is carried over from the live run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

from . import fidelity, hitrate, metrics
from .records import Record, read


class RunError(ValueError):
    """A run folder that cannot give a complete report; the message names the file."""


def _load(folder: Path) -> tuple[dict, list[dict], dict[tuple[str, str], list[Record]]]:
    folder = Path(folder)
    run_file = folder / "run.json"
    if not run_file.exists():
        raise RunError(f"{run_file}: missing; not a kvscope run folder")
    run = json.loads(run_file.read_text())
    status_file = folder / "status.jsonl"
    status = [json.loads(line) for line in status_file.read_text().splitlines()] if status_file.exists() else []
    recs = {}
    for server in run["servers"]:
        for scenario in run["scenarios"]:
            path = folder / "records" / f"{server['config']}__{scenario}.jsonl"
            if not path.exists():
                if server["role"] == "golden":
                    raise RunError(f"{path}: golden records missing; fidelity cannot be scored without them")
                recs[server["config"], scenario] = []
                continue
            try:
                recs[server["config"], scenario] = read(path)
            except ValueError as exc:
                raise RunError(str(exc)) from exc
    return run, status, recs


def workload_digest(folder: Path) -> str:
    """Identity of a run's workload: the hash of its workload files."""
    digest = hashlib.sha256()
    for path in sorted((Path(folder) / "workloads").glob("*.jsonl")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _pct(values, q) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def served_dtype(server: dict) -> str | None:
    args = server.get("server_args", [])
    return args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else None


def near_tie(run: dict) -> float:
    """The near-tie band of this run: by the golden server's dtype."""
    return fidelity.near_tie_nats(served_dtype(next(s for s in run["servers"] if s["role"] == "golden")))


def score_run(run: dict, recs: dict) -> pd.DataFrame:
    golden = next(s["config"] for s in run["servers"] if s["role"] == "golden")
    band = near_tie(run)
    rows = []
    for (config, scenario), records in recs.items():
        rows += fidelity.score_all(recs[golden, scenario], records, band)
    return pd.DataFrame(rows)


def summarize(run: dict, status: list[dict], recs: dict, scores: pd.DataFrame) -> pd.DataFrame:
    servers = {s["config"]: s for s in run["servers"]}
    golden = next(c for c, s in servers.items() if s["role"] == "golden")
    deltas = {(row["config"], row["scenario"]): (row["phases"].get("measure") or {}).get("metrics_delta")
              for row in status}
    rows = []
    for (config, scenario), records in recs.items():
        server = servers[config]
        measure = [r for r in records if r.phase == "measure"]
        ok = [r for r in measure if r.ok]
        hit = [r for r in ok if r.cached_tokens]
        miss = [r for r in ok if not r.cached_tokens]
        gold = {r.request_id: r for r in recs[golden, scenario] if r.ok}
        paired = [(gold[r.request_id].ttft_s, r.ttft_s) for r in ok if r.request_id in gold]
        paired_hits = [(gold[r.request_id].ttft_s, r.ttft_s) for r in hit if r.request_id in gold]
        sc = scores[(scores.config == config) & (scores.scenario == scenario)] if len(scores) else scores
        cls = lambda frame, name: int((frame.cls == name).sum()) if len(frame) else 0  # noqa: E731
        hit_sc = sc[sc.cached_tokens.fillna(0) > 0] if len(sc) else sc
        miss_sc = sc[sc.cached_tokens.fillna(0) == 0] if len(sc) else sc
        delta = deltas.get((config, scenario))
        rates = metrics.hit_rates(delta) if delta else {"local": None, "external": None, "overall": None}
        rows.append({
            "config": config, "role": server["role"], "scenario": scenario,
            "requests": len(measure), "failed": len(measure) - len(ok),
            "hit_requests": len(hit),
            "ttft_p50_ms_all": _ms(_pct([r.ttft_s for r in ok], 50)),
            "ttft_p50_ms_miss": _ms(_pct([r.ttft_s for r in miss], 50)),
            "ttft_p90_ms_miss": _ms(_pct([r.ttft_s for r in miss], 90)),
            "ttft_p99_ms_miss": _ms(_pct([r.ttft_s for r in miss], 99)),
            "ttft_p50_ms_hit": _ms(_pct([r.ttft_s for r in hit], 50)),
            "ttft_p90_ms_hit": _ms(_pct([r.ttft_s for r in hit], 90)),
            "ttft_p99_ms_hit": _ms(_pct([r.ttft_s for r in hit], 99)),
            "itl_p50_ms": _ms(_pct([x for r in ok for x in r.itl_s], 50)),
            "e2e_p50_ms": _ms(_pct([r.e2e_s for r in ok], 50)),
            "speedup_all": _ratio(paired),
            "speedup_hits": _ratio(paired_hits),
            "hit_rate_per_request": hitrate.per_request(measure),
            "hit_rate_counters": rates["overall"],
            "hit_rate_counters_local": rates["local"],
            "hit_rate_counters_external": rates["external"],
            "hit_rate_theoretical": hitrate.theoretical(measure, server.get("kv_capacity_tokens"),
                                                        server.get("block_size") or 128),
            "identical_hit": cls(hit_sc, "identical"), "benign_hit": cls(hit_sc, "benign"),
            "fail_hit": cls(hit_sc, "FAIL"),
            "identical_miss": cls(miss_sc, "identical"), "benign_miss": cls(miss_sc, "benign"),
            "fail_miss": cls(miss_sc, "FAIL"),
            "unscored": int((~sc.cls.isin(fidelity.SCORED)).sum()) if len(sc) else 0,
            "degenerate": int(sc.degenerate.sum()) if len(sc) else 0,
            "needle_golden": _share(sc.needle_golden) if len(sc) else None,
            "needle_candidate": _share(sc.needle_candidate) if len(sc) else None,
            "verdict": fidelity.verdict(list(sc.cls)) if len(sc) else "NO-DATA",
        })
    return pd.DataFrame(rows)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _ratio(pairs) -> float | None:
    """Median golden TTFT over median candidate TTFT on the same requests (>1: the candidate is faster)."""
    pairs = [(g, c) for g, c in pairs if g is not None and c]
    if not pairs:
        return None
    return round(float(np.median([g for g, _ in pairs]) / np.median([c for _, c in pairs])), 2)


def _share(col: pd.Series) -> float | None:
    col = col.dropna()
    return round(float(col.astype(bool).mean()), 3) if len(col) else None


def config_verdicts(summary: pd.DataFrame) -> pd.DataFrame:
    """One line per config: fidelity verdict over all scenarios and the speed-up its hits buy."""
    out = []
    for config, part in summary.groupby("config", sort=False):
        seen = set(part.verdict)
        verdict = "FAIL" if "FAIL" in seen else "PASS" if "PASS" in seen else "NO-DATA"
        expected = "FAIL" if part.role.iloc[0] == "canary" else "PASS"
        out.append({
            "config": config, "role": part.role.iloc[0], "verdict": verdict,
            "as_expected": verdict == expected,
            "fail_requests": int(part.fail_hit.sum() + part.fail_miss.sum()),
            "scored": int((part.identical_hit + part.benign_hit + part.fail_hit + part.identical_miss
                           + part.benign_miss + part.fail_miss).sum()),
            "hit_requests": int(part.hit_requests.sum()), "failed_requests": int(part.failed.sum()),
            "speedup_hits_median": _median(part.speedup_hits), "speedup_all_median": _median(part.speedup_all),
        })
    return pd.DataFrame(out)


def crashed_verdicts(run: dict) -> pd.DataFrame:
    """A row for each config that did not start: it has no answers, and that is a result too."""
    return pd.DataFrame([{"config": c["config"], "role": c.get("role", "candidate"), "verdict": "CRASHED", "as_expected": False,
                          "fail_requests": 0, "scored": 0, "hit_requests": 0, "failed_requests": 0,
                          "speedup_hits_median": None, "speedup_all_median": None} for c in run.get("crashed", [])])


def _median(col: pd.Series) -> float | None:
    col = col.dropna()
    return round(float(col.median()), 2) if len(col) else None


def plots(folder: Path, summary: pd.DataFrame, recs: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    configs = list(dict.fromkeys(summary.config))
    scenarios = list(dict.fromkeys(summary.scenario))

    fig, ax = plt.subplots(figsize=(7, 4))
    for config in configs:
        ttft = sorted(r.ttft_s * 1000 for (c, _), rs in recs.items() if c == config for r in rs
                      if r.ok and r.phase == "measure")
        if ttft:
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=config)
    ax.set(xscale="log", xlabel="TTFT (ms, log)", ylabel="share of requests", title="TTFT CDF, all scenarios")
    ax.legend(fontsize=8)
    made.append(_save(fig, folder / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for config in configs:
        pts = [((r.cached_tokens or 0) / r.prompt_tokens, r.ttft_s * 1000) for (c, _), rs in recs.items()
               if c == config for r in rs if r.ok and r.prompt_tokens and r.phase == "measure"]
        if pts:
            ax.scatter(*zip(*pts), s=12, alpha=0.7, label=config)
    ax.set(xlabel="cached share of prompt tokens", ylabel="TTFT (ms)", title="TTFT vs cached-token share")
    ax.legend(fontsize=8)
    made.append(_save(fig, folder / "ttft_vs_cached.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r.config}\n{r.scenario}" for r in summary.itertuples()]
    x = np.arange(len(labels))
    for offset, col, name in ((-0.27, "hit_rate_per_request", "per request"), (0, "hit_rate_counters", "counters"),
                              (0.27, "hit_rate_theoretical", "theoretical LRU")):
        ax.bar(x + offset, summary[col].fillna(0), width=0.27, label=name)
    ax.set_xticks(x, labels, fontsize=6, rotation=90)
    ax.set(ylabel="hit rate (tokens)", title="Hit rate: measured vs theoretical")
    ax.legend(fontsize=8)
    made.append(_save(fig, folder / "hit_rates.png"))

    grid = np.full((len(configs), len(scenarios)), np.nan)
    text = [["" for _ in scenarios] for _ in configs]
    for r in summary.itertuples():
        scored = r.identical_hit + r.benign_hit + r.fail_hit + r.identical_miss + r.benign_miss + r.fail_miss
        i, j = configs.index(r.config), scenarios.index(r.scenario)
        if scored:
            grid[i, j] = (r.fail_hit + r.fail_miss) / scored
            text[i][j] = f"{r.verdict}\n{r.identical_hit + r.identical_miss}/{scored} identical"
        else:
            text[i][j] = r.verdict
    fig, ax = plt.subplots(figsize=(1.8 * len(scenarios) + 2, 0.7 * len(configs) + 1.5))
    ax.imshow(grid, cmap="RdYlGn_r", vmin=0, vmax=1, aspect="auto")
    for i in range(len(configs)):
        for j in range(len(scenarios)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8)
    ax.set_yticks(range(len(configs)), configs, fontsize=8)
    ax.set_title("Fidelity vs golden (red: share of FAIL)")
    made.append(_save(fig, folder / "fidelity_matrix.png"))
    return made


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def _md_table(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write(folder: Path) -> int:
    """Write report.md, summary.csv, scores.csv and the plots; return the gate's exit code."""
    folder = Path(folder)
    run, status, recs = _load(folder)
    scores = score_run(run, recs)
    summary = summarize(run, status, recs, scores)
    verdicts, crashed = config_verdicts(summary), crashed_verdicts(run)
    if len(crashed):
        verdicts = pd.concat([verdicts, crashed], ignore_index=True)
    scores.to_csv(folder / "scores.csv", index=False)
    summary.to_csv(folder / "summary.csv", index=False)
    verdicts.to_csv(folder / "verdicts.csv", index=False)
    pngs = plots(folder, summary, recs)
    (folder / "report.md").write_text(_markdown(run, status, summary, verdicts, scores, pngs, folder))
    return 0 if verdicts.as_expected.all() else 1


def _markdown(run, status, summary, verdicts, scores, pngs, folder) -> str:
    m = run["machine"]
    first = run["servers"][0]
    lines = [f"# kvscope report: run {run['run_id']}", ""]
    lines += ["Every figure here is computed from this folder's raw records (`records/*.jsonl`) by "
              f"`make report RUN={folder}`. Fidelity compares each answer with the golden config's answer to "
              f"the same request (greedy, same seed); speed-up = golden TTFT p50 / config TTFT p50 on the same "
              "requests (>1 is faster).", ""]
    lines += ["## Verdicts", ""]
    v = verdicts.copy()
    v["verdict"] = [f"**{x}**" + ("" if ok else " (unexpected)") for x, ok in zip(v.verdict, v.as_expected)]
    lines += [_md_table(v.drop(columns=["as_expected"])), ""]
    crashed = {c["config"]: c for c in run.get("crashed", [])}
    for row in verdicts.itertuples():
        if row.config in crashed:
            lines.append(f"- `{row.config}`: **did not start** ({crashed[row.config]['why']}): "
                         f"`{crashed[row.config]['error']}`")
            continue
        speed = (f"speed-up {row.speedup_hits_median}x on its cache hits (golden TTFT p50 / its TTFT p50)"
                 if pd.notna(row.speedup_hits_median) and row.hit_requests else "no cache hits")
        tag = " (fault-injection canary: FAIL is the expected result)" if row.role == "canary" else ""
        lines.append(f"- `{row.config}`: fidelity **{row.verdict}**, {row.fail_requests} FAIL of {row.scored} "
                     f"scored answers, {speed}{tag}.")
    lines += ["", "## Environment", ""]
    lines += [f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['arch']}, "
              f"GPU: {m['gpu'] or 'none'}; {m['os']}",
              f"- vLLM {first['vllm_version']} ({first['platform']}), model `{Path(first['model_path']).name}` "
              f"sha256 `{first['model_hash'][:16]}…`, KV capacity {first['kv_capacity_tokens']} tokens, "
              f"block {first.get('block_size')} tokens",
              f"- server packages: {_packages(first.get('packages'))}; model shape: {_shape(first.get('model_config'))}",
              f"- load: {run['load']}; workload digest `{workload_digest(folder)}`",
              f"- command: `{run['command']}`", ""]
    lines += ["| config | role | port | flags | kv-transfer-config |", "|---|---|---|---|---|"]
    for s in run["servers"]:
        args = s["server_args"]
        ktc = args[args.index("--kv-transfer-config") + 1] if "--kv-transfer-config" in args else "–"
        skip = {args.index("--model") + 1, args.index("--kv-transfer-config") + 1} if ktc != "–" else {args.index("--model") + 1}
        flags = " ".join(a for i, a in enumerate(args) if i not in skip and a not in ("--model", "--kv-transfer-config"))
        lines.append(f"| {s['config']} | {s['role']} | {s['port']} | `{flags}` | `{ktc}` |")
    lines += ["", "## Speed and hit rate per config and scenario", ""]
    lines += ["TTFT in ms; `miss` = requests with no cached tokens (cold), `hit` = requests that reused cached "
              "tokens (warm). Hit rates are token shares: per request (server usage), from /metrics counter "
              "deltas, and theoretical (the run's block trace through an LRU of the server's capacity).", ""]
    speed_cols = ["config", "scenario", "requests", "failed", "hit_requests", "ttft_p50_ms_miss", "ttft_p90_ms_miss",
                  "ttft_p99_ms_miss", "ttft_p50_ms_hit", "ttft_p90_ms_hit", "ttft_p99_ms_hit", "itl_p50_ms",
                  "e2e_p50_ms", "speedup_hits", "speedup_all"]
    lines += [_md_table(summary[speed_cols]), ""]
    hit_cols = ["config", "scenario", "hit_rate_per_request", "hit_rate_counters", "hit_rate_counters_local",
                "hit_rate_counters_external", "hit_rate_theoretical"]
    lines += [_md_table(summary[hit_cols]), ""]
    lines += ["## Fidelity per config and scenario", "",
              f"Classes split by whether the request hit the cache. Near tie: each side's token within "
              f"{near_tie(run)} nats of the other side's best logprob (band for dtype "
              f"{served_dtype(run['servers'][0]) or 'default'}). `unscored`: failed requests, missing golden answers, or inputs that "
              "differ from golden's (later turns after a divergence).", ""]
    fid_cols = ["config", "scenario", "identical_hit", "benign_hit", "fail_hit", "identical_miss", "benign_miss",
                "fail_miss", "unscored", "degenerate", "needle_golden", "needle_candidate", "verdict"]
    lines += [_md_table(summary[fid_cols]), ""]
    fails = scores[scores.cls == "FAIL"] if len(scores) else scores
    if len(fails):
        lines += ["First FAIL reasons (up to 10):", ""]
        for r in fails.head(10).itertuples():
            lines.append(f"- `{r.config}` / `{r.request_id}` (cached {r.cached_tokens}): {r.reason}")
        lines.append("")
    failed = scores[scores.cls == "failed"] if len(scores) else scores
    if len(failed):
        lines += ["Failed requests (first error of each config):", ""]
        for config, part in failed.groupby("config"):
            lines.append(f"- `{config}`: {len(part)} failed; first: {part.reason.iloc[0]}")
        lines.append("")
    faults = [r for r in status for p in r["phases"].values() if p.get("locust_exit") not in (0, 1)
              or p.get("metrics_error")]
    if faults:
        lines += ["Faults during the run:", ""]
        for r in faults:
            for name, p in r["phases"].items():
                lines.append(f"- `{r['config']}` x `{r['scenario']}` {name}: locust exit {p.get('locust_exit')}, "
                             f"{p.get('metrics_error') or ''} {' '.join(p.get('locust_stderr_tail') or [])}"
                             + (f" server log: `{p['server_error']}`" if p.get("server_error") else ""))
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in pngs] + [""]
    lines += ["Tables as CSV: `summary.csv`, `verdicts.csv`, `scores.csv` (one row per request and config).", ""]
    return "\n".join(lines)


def _packages(packages: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (packages or {}).items()) or "not recorded"


def _shape(config: dict | None) -> str:
    if not config:
        return "not recorded"
    return (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {config['num_attention_heads']} "
            f"heads / {config['num_key_value_heads']} KV heads x {config.get('head_dim')}, vocab "
            f"{config['vocab_size']}, weights stored as {config.get('torch_dtype')}")


def compare(folders: list[Path], out: Path | None = None) -> str:
    """Two or more runs side by side; they must have replayed the same workload."""
    digests = {str(f): workload_digest(f) for f in folders}
    if len(set(digests.values())) != 1:
        raise RunError(f"runs replayed different workloads (digests {digests}); comparing them would mislead")
    frames = []
    for f in folders:
        run, status, recs = _load(f)
        summary = summarize(run, status, recs, score_run(run, recs))
        summary.insert(0, "run", run["run_id"])
        summary.insert(1, "vllm", run["servers"][0]["vllm_version"])
        frames.append(summary)
    table = pd.concat(frames)
    cols = ["run", "vllm", "config", "scenario", "ttft_p50_ms_miss", "ttft_p50_ms_hit", "speedup_hits",
            "hit_rate_per_request", "hit_rate_theoretical", "fail_hit", "fail_miss", "verdict"]
    text = "# kvscope comparison\n\n" + _md_table(table[cols].sort_values(["config", "scenario", "run"])) + "\n"
    if out:
        Path(out).write_text(text)
    return text
