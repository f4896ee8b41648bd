"""`tidal report RUN_DIR`: one self-contained HTML file next to summary.json (report.html) that a CI
job can attach and a person can read: the reward and held-out accuracy curves, the per-iteration
time split, and the summary table. Inline SVG and CSS only: no script, no network, no dependency.

Reads metrics.jsonl (one line per iteration), summary.json, eval.jsonl (the held-out curve, when
eval.every is set) and config.yaml, all from the run directory.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path

from tidal.rundir import RunDir
from tidal.summary import TIME_SPLIT

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
SPLIT = [  # trainer phases stacked per iteration: (label, metrics.jsonl key, colour)
    ("train", "train_seconds", "#1f77b4"),
    ("weight-sync", "sync_seconds", "#ff7f0e"),
    ("idle (waiting for groups)", "trainer_idle_seconds", "#bbbbbb"),
]
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 640, 280, 56, 16, 28, 40


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


class _Frame:
    """The axes of one chart: data coordinates to SVG pixels, grid, ticks and labels."""

    def __init__(self, xs: list[float], ys: list[float], y0: bool = False, y_range: tuple[float, float] | None = None):
        self.x_lo, self.x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.x_hi == self.x_lo:
            self.x_lo, self.x_hi = self.x_lo - 0.5, self.x_hi + 0.5
        lo, hi = y_range if y_range else ((min(ys), max(ys)) if ys else (0.0, 1.0))
        if y0:
            lo = min(lo, 0.0)
        if hi == lo:
            lo, hi = lo - 0.5, hi + 0.5
        pad = 0 if y_range else (hi - lo) * 0.05
        self.y_lo, self.y_hi = (lo if (y0 or y_range) else lo - pad), hi + pad

    def x(self, v: float) -> float:
        return PAD_L + (v - self.x_lo) / (self.x_hi - self.x_lo) * (W - PAD_L - PAD_R)

    def y(self, v: float) -> float:
        return H - PAD_B - (v - self.y_lo) / (self.y_hi - self.y_lo) * (H - PAD_T - PAD_B)

    def axes(self, xlabel: str, ylabel: str, integer_x: bool = True) -> list[str]:
        out = []
        for t in _ticks(self.y_lo, self.y_hi):
            y = self.y(t)
            out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            out.append(f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        xt = [t for t in _ticks(self.x_lo, self.x_hi, 8) if not integer_x or abs(t - round(t)) < 1e-9]
        for t in xt:
            x = self.x(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{H - PAD_B}" y2="{H - PAD_B + 4}" class="axis"/>')
            out.append(f'<text x="{x:.1f}" y="{H - PAD_B + 16}" text-anchor="middle">{_fmt(t)}</text>')
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{H - PAD_B}" y2="{H - PAD_B}" class="axis"/>')
        out.append(f'<line x1="{PAD_L}" x2="{PAD_L}" y1="{PAD_T}" y2="{H - PAD_B}" class="axis"/>')
        out.append(f'<text x="{(PAD_L + W - PAD_R) / 2:.0f}" y="{H - 6}" text-anchor="middle" class="label">{html.escape(xlabel)}</text>')
        out.append(
            f'<text transform="translate(14,{(PAD_T + H - PAD_B) / 2:.0f}) rotate(-90)" text-anchor="middle" class="label">{html.escape(ylabel)}</text>'
        )
        return out


def _legend(items: list[tuple[str, str, str]]) -> str:
    """(label, colour, kind: line | box) as an HTML legend under the chart."""
    spans = []
    for label, color, kind in items:
        swatch = "swatch-line" if kind == "line" else "swatch-box"
        spans.append(f'<span class="key"><span class="{swatch}" style="background:{color}"></span>{html.escape(label)}</span>')
    return f'<div class="legend">{"".join(spans)}</div>'


def _svg(body: list[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{html.escape(title)}">'
        + "".join(body)
        + "</svg>"
    )


def line_chart(title: str, series: list[tuple[str, list[float], list[float | None]]], xlabel: str, ylabel: str, y_range=None) -> str:
    """One SVG line chart: each series (name, xs, ys) a polyline with a dot (and tooltip) per point."""
    pts = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys) if y is not None]
    if not pts:
        return f'<figure><figcaption>{html.escape(title)}</figcaption><p class="empty">no data</p></figure>'
    frame = _Frame([p[0] for p in pts], [p[1] for p in pts], y_range=y_range)
    body = frame.axes(xlabel, ylabel)
    legend = []
    for i, (name, xs, ys) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        kept = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if not kept:
            continue
        legend.append((name, color, "line"))
        path = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in kept)
        body.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2" class="series" data-name="{html.escape(name)}"/>')
        if len(kept) <= 200:
            for x, y in kept:
                tip = f"{name} @ {_fmt(x)}: {y:.4g}"
                body.append(f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="3" fill="{color}"><title>{html.escape(tip)}</title></circle>')
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{_svg(body, title)}{_legend(legend)}</figure>"


def time_split_chart(metrics: list[dict]) -> str:
    """Per iteration: the trainer's seconds stacked as train / weight-sync / idle / other (bars, they
    add up to the iteration time), and the rollout's generation span (a line: in periodic and bounded
    modes it overlaps the trainer's phases, which is the point of those modes)."""
    title = "Seconds per iteration: trainer split (bars) and generation span (line)"
    if not metrics:
        return f'<figure><figcaption>{title}</figcaption><p class="empty">no data</p></figure>'
    xs = [m.get("iteration", i) for i, m in enumerate(metrics)]
    totals = [_num(m.get("iteration_seconds")) or 0.0 for m in metrics]
    gen = [_num(m.get("generate_seconds")) for m in metrics]
    top = max([*totals, *(g or 0.0 for g in gen)]) or 1.0
    frame = _Frame([x - 0.5 for x in xs] + [x + 0.5 for x in xs], [], y_range=(0.0, top * 1.05))
    body = frame.axes("iteration", "seconds")
    bar_w = max(1.0, (frame.x(1) - frame.x(0)) * 0.7)
    for x, m, total in zip(xs, metrics, totals):
        base = 0.0
        parts = [(label, _num(m.get(key)) or 0.0, color) for label, key, color in SPLIT]
        parts.append(("other", max(0.0, total - sum(p[1] for p in parts)), "#e6e6e6"))
        for label, secs, color in parts:
            if secs <= 0:
                continue
            y_top, y_bot = frame.y(base + secs), frame.y(base)
            tip = f"iteration {x}: {label} {secs:.3f}s of {total:.3f}s"
            body.append(
                f'<rect x="{frame.x(x) - bar_w / 2:.1f}" y="{y_top:.1f}" width="{bar_w:.1f}" height="{max(0.5, y_bot - y_top):.1f}" '
                f'fill="{color}" class="bar" data-phase="{html.escape(label)}"><title>{html.escape(tip)}</title></rect>'
            )
            base += secs
    kept = [(x, g) for x, g in zip(xs, gen) if g is not None]
    if kept:
        path = " ".join(f"{frame.x(x):.1f},{frame.y(g):.1f}" for x, g in kept)
        body.append(f'<polyline points="{path}" fill="none" stroke="#2ca02c" stroke-width="2" class="series" data-name="generate"/>')
    legend = [(label, color, "box") for label, _, color in SPLIT] + [("other", "#e6e6e6", "box"), ("generate (rollout span)", "#2ca02c", "line")]
    return f"<figure><figcaption>{title}</figcaption>{_svg(body, title)}{_legend(legend)}</figure>"


def _pct(v) -> str:
    return "n/a" if _num(v) is None else f"{float(v):.1%}"


def _value(key: str, v) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return html.escape(str(v))
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return _pct(v) if "accuracy" in key or key.startswith(("pass_at_", "maj_at_")) else f"{v:.4g}"
    return html.escape(json.dumps(v))


def summary_table(summary: dict) -> str:
    rows = [f"<tr><th>{html.escape(k)}</th><td>{_value(k, v)}</td></tr>" for k, v in summary.items() if not isinstance(v, list | dict)]
    return f'<table class="summary">{"".join(rows)}</table>'


def failures_table(summary: dict) -> str:
    """Every reward and environment method that failed during the run, by name: its calls, failures and
    first error (summary.json's `failures`), and the rewards that scored 0 for an error; empty when none did."""
    failing = sorted((name, t) for name, t in (summary.get("failures") or {}).items() if t[1])
    errors = int(summary.get("reward_errors") or 0)
    if not failing and not errors:
        return ""
    rows = "".join(
        f"<tr><th>{html.escape(name)}</th><td>{int(calls)}</td><td>{int(failed)}</td><td><code>{html.escape(str(error))}</code></td></tr>"
        for name, (calls, failed, error) in failing
    )
    table = (
        f'<table class="failures"><tr><th>reward or method</th><th>calls</th><th>failed</th><th>first error</th></tr>{rows}</table>' if rows else ""
    )
    return (
        f'<h2>Failures</h2><p class="note">{errors} reward(s) scored 0 for an error; each one is in the run\'s logs '
        f"(logs/worker-*.log; sync mode: logs/launcher.log).</p>{table}"
    )


def split_table(summary: dict, metrics: list[dict]) -> str:
    """The mean split, as the end-of-run table prints it."""
    cells = []
    for label, skey, mkey in TIME_SPLIT:
        v = _num(summary.get(skey))
        if v is None and metrics:
            vals = [x for m in metrics if (x := _num(m.get(mkey))) is not None]
            v = sum(vals) / len(vals) if vals else None
        cells.append(f"<tr><th>{label}</th><td>{'n/a' if v is None else f'{v:.3f} s'}</td></tr>")
    return f'<table class="split">{"".join(cells)}</table>'


def heldout_series(summary: dict, evals: list[dict], iterations: int) -> tuple[list, str]:
    """The held-out curve: eval.jsonl's points (eval.every), else before (version 0) and after (the
    final version) from summary.json."""
    points = evals or summary.get("eval_curve") or []
    if points:
        xs = [p["version"] for p in points]
        series = [("greedy", xs, [_num(p.get("accuracy")) for p in points])]
        if any(_num(p.get("sampled_accuracy")) is not None for p in points):
            series.append(("sampled", xs, [_num(p.get("sampled_accuracy")) for p in points]))
        return series, f"{len(points)} evaluations while training (eval.every)"
    series = []
    for name, key in (("greedy", "accuracy"), ("sampled", "sampled_accuracy")):
        before, after = _num(summary.get(f"{key}_before")), _num(summary.get(f"{key}_after"))
        if before is not None or after is not None:
            series.append((name, [0, iterations], [before, after]))
    return series, "before and after the run (set eval.every for a curve)"


CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:1.4em;margin-bottom:4px} h2{font-size:1.1em;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555;font-size:.9em} .meta code{background:#f4f4f4;padding:1px 4px}
.charts{display:flex;flex-wrap:wrap;gap:16px} figure{margin:0;border:1px solid #e3e3e3;border-radius:6px;padding:8px;background:#fff}
figcaption{font-weight:600;font-size:.95em;margin-bottom:4px} svg{font-size:11px;max-width:100%;height:auto}
svg .grid{stroke:#eee} svg .axis{stroke:#888} svg .label{font-size:12px;fill:#444} svg text{fill:#555}
.legend{font-size:.85em;color:#444;margin-top:4px} .key{margin-right:14px;white-space:nowrap}
.swatch-line{display:inline-block;width:18px;height:3px;vertical-align:middle;margin-right:5px}
.swatch-box{display:inline-block;width:11px;height:11px;vertical-align:middle;margin-right:5px}
table{border-collapse:collapse;font-size:.9em} th,td{border:1px solid #e3e3e3;padding:3px 10px;text-align:left} th{background:#fafafa;font-weight:500}
td{font-variant-numeric:tabular-nums} .empty{color:#999} .note{color:#666;font-size:.85em}
.tables{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
details{margin-top:12px} details table{font-size:.8em}
"""

PER_ITERATION_COLUMNS = [
    "iteration",
    "reward_mean",
    "accuracy",
    "pass_at_group_size",
    "zero_advantage_group_fraction",
    "policy_loss",
    "kl",
    "grad_norm",
    "response_length_mean",
    "staleness_max",
    "iteration_seconds",
    "generate_seconds",
    "train_seconds",
    "sync_seconds",
    "trainer_idle_seconds",
    "generated_tokens_per_s",
]


def iteration_table(metrics: list[dict]) -> str:
    cols = [c for c in PER_ITERATION_COLUMNS if any(c in m for m in metrics)]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    rows = []
    for m in metrics:
        cells = []
        for c in cols:
            v = _num(m.get(c))
            cells.append(f"<td>{'' if v is None else (f'{int(v)}' if c == 'iteration' else f'{v:.4g}')}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f"<details><summary>Every iteration ({len(metrics)})</summary><table><tr>{head}</tr>{''.join(rows)}</table></details>"


def build_report(run_dir: str | Path) -> str:
    """The report's HTML for a finished (or running) run directory."""
    run = RunDir(run_dir)
    metrics = run.metrics.read()
    summary = json.loads(run.summary.read_text()) if run.summary.is_file() else {}
    if not metrics and not summary:
        raise FileNotFoundError(f"{run_dir}: neither metrics.jsonl nor summary.json; is it a Tidal run directory?")
    evals = run.evals.read()
    config = {}
    if run.config.is_file():
        import yaml

        config = yaml.safe_load(run.config.read_text()) or {}
    xs = [m.get("iteration", i) for i, m in enumerate(metrics)]
    iterations = int(summary.get("iterations") or len(metrics))
    reward = line_chart(
        "Reward (training samples, per iteration)",
        [
            ("reward_mean", xs, [_num(m.get("reward_mean")) for m in metrics]),
            ("accuracy", xs, [_num(m.get("accuracy")) for m in metrics]),
            ("pass@G", xs, [_num(m.get("pass_at_group_size")) for m in metrics]),
        ],
        "iteration",
        "mean over the iteration's samples",
    )
    held_series, held_note = heldout_series(summary, evals, iterations)
    heldout = line_chart("Held-out accuracy", held_series, "policy version", "accuracy", y_range=(0.0, 1.0))
    model = (config.get("model") or {}).get("name_or_path") or ("tiny (built-in)" if (config.get("model") or {}).get("tiny") else "")
    meta = [
        f"mode <code>{html.escape(str(summary.get('mode') or config.get('mode', '?')))}</code>",
        f"{iterations} iterations",
    ]
    if model:
        meta.append(f"model <code>{html.escape(str(model))}</code>")
    if summary.get("mlflow_run_id"):
        meta.append(
            f"MLflow run <code>{html.escape(summary['mlflow_run_id'])}</code> in <code>{html.escape(str(summary.get('tracking_uri', '')))}</code>"
        )
    if _num(summary.get("wall_seconds")) is not None:
        meta.append(f"{summary['wall_seconds']:.0f} s wall")
    headline = ""
    if summary:
        headline = (
            f"<p>Held-out accuracy (greedy) {_pct(summary.get('accuracy_before'))} &rarr; {_pct(summary.get('accuracy_after'))}; "
            f"sampled {_pct(summary.get('sampled_accuracy_before'))} &rarr; {_pct(summary.get('sampled_accuracy_after'))}.</p>"
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Tidal run report: {html.escape(run.root.name)}</title>
<style>{CSS}</style></head>
<body>
<h1>Tidal run report: {html.escape(run.root.name)}</h1>
<p class="meta">{" &middot; ".join(meta)}<br>run directory <code>{html.escape(str(run.root.resolve()))}</code></p>
{headline}
<h2>Curves</h2>
<div class="charts">{reward}{heldout}</div>
<p class="note">Held-out accuracy: {html.escape(held_note)}.</p>
<h2>Time per iteration</h2>
<div class="charts">{time_split_chart(metrics)}</div>
<div class="tables"><div><p class="note">Means over the run (summary.json)</p>{split_table(summary, metrics)}</div></div>
{iteration_table(metrics) if metrics else ""}
{failures_table(summary)}
<h2>Summary</h2>
{summary_table(summary) if summary else '<p class="empty">no summary.json (the run has not finished)</p>'}
</body></html>
"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    path = Path(out) if out else RunDir(run_dir).report
    path.write_text(build_report(run_dir))
    return path


def register(sub) -> None:
    rep = sub.add_parser("report", help="a self-contained HTML report of a run (report.html next to summary.json)")
    rep.add_argument("run_dir", help="run directory")
    rep.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html)")
    rep.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        path = write_report(args.run_dir, args.out)
    except FileNotFoundError as err:
        print(f"tidal report: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
