"""What ``make bench`` writes: the markdown tables, the goals' verdicts, the chart, and the
README / docs/benchmarks.md blocks between the bench markers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mechanism
import torch
import torch.multiprocessing  # noqa: F401  (installs torch's reducers into ForkingPickler)
from harness import BASELINE, HERE, MIB, REGISTERED
from scenarios import SCENARIOS

README = HERE.parent / "README.md"
BENCH_DOC = HERE.parent / "docs" / "benchmarks.md"  # the full table; README has the summary
MARK_START, MARK_END = "<!-- bench:start -->", "<!-- bench:end -->"


def verdict(goal: dict) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[goal["pass"]]


def goal_line(goal: dict) -> str:
    number = f"{fmt(goal['achieved'])}{'' if goal['versus'] else ' '}{goal['unit']}"
    if goal["pass"] is None:
        number = f"{goal['versus']} not measured"
    return f"goal {goal['scenario']:>2} {goal['impl']:<13} {goal['goal']:<30} {number:<34} {verdict(goal)}"


# -- output --------------------------------------------------------------------------------


def fmt(value: float) -> str:
    if value != value:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def markdown_table(summary: dict, goals: list[dict]) -> str:
    verdicts: dict[tuple[str, str], list[str]] = {}
    for g in goals:
        number = "" if g["pass"] is None or g["versus"] is None else f"{fmt(g['achieved'])}x: "
        verdicts.setdefault((g["scenario"], g["impl"]), []).append(f"{verdict(g)} ({number}{g['goal']})")
    lines = [
        "| scenario | implementation | median | unit | vs torch (same strategy) | round trips/msg | goal |",
        "| --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    for scenario in SCENARIOS:
        for impl, row in summary.get(scenario.key, {}).items():
            rt = fmt(row["round_trips_per_msg"]) if impl in REGISTERED else ""
            extra = f" (p50 {fmt(row['p50_ms'])})" if "p50_ms" in row else ""
            err = f" ⚠ {len(row['errors'])} failed" if row["errors"] else ""
            goal = "; ".join(verdicts.get((scenario.key, impl), []))
            lines.append(
                f"| {scenario.key} {scenario.title} | {impl} | {fmt(row['median'])}{extra}{err} | "
                f"{scenario.unit} | {fmt(row['ratio'])}x | {rt} | {goal} |"
            )
    return "\n".join(lines)


def holding_table(summary: dict) -> str:
    rows = summary.get("6")
    if not rows:
        return ""
    lines = [
        "| scenario 6 (1,000 kept) | consumer fds | producer fds | consumer memfd segments / MiB | /dev/shm growth MiB | broker fds |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for impl, r in rows.items():
        lines.append(
            f"| {impl} | {fmt(r['median'])} | {fmt(r.get('producer_fds', float('nan')))} | "
            f"{fmt(r.get('consumer_memfd_segments', float('nan')))} / "
            f"{fmt(r.get('consumer_memfd_bytes', float('nan')) / MIB)} | "
            f"{fmt(r.get('dev_shm_bytes', float('nan')) / MIB)} | {fmt(r.get('broker_fds', float('nan')))} |"
        )
    return "\n".join(lines)


COLORS = {
    "shmreduce-fd": "#1f77b4",
    "shmreduce-fs": "#6baed6",
    "torch-fd": "#d62728",
    "torch-fs": "#ff9896",
    "by-value": "#7f7f7f",
    "floor": "#c7c7c7",
    "shm-recipe": "#2ca02c",
    "tensordict-torch": "#ff7f0e",
    "tensordict-shmreduce": "#9467bd",
    "memcpy": "#000000",
    "make-only": "#8c564b",
}


def bar_label(row: dict, impl: str, unit: str) -> str:
    """What is written on a bar: the median, and its ratio to torch with the same strategy."""
    value = f"{fmt(row['median'])} {unit}"
    base = BASELINE.get(impl, "torch-fd")
    if impl == base or row["ratio"] != row["ratio"]:
        return value
    return f"{value}   {fmt(row['ratio'])}x {base}"


def draw_chart(summary: dict, path: Path, meta: dict | None = None, date: str = "") -> None:
    """One panel per scenario in a grid two wide (readable at README width), horizontal bars
    named on the left, each with its median and its ratio to torch written on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in SCENARIOS if s.key in summary]
    cols = 2
    rows_n = (len(shown) + 1 + cols - 1) // cols  # one more cell: the key
    heights = [
        max(len(summary[s.key]) for s in shown[i * cols : (i + 1) * cols]) if shown[i * cols : (i + 1) * cols] else 4 for i in range(rows_n)
    ]
    fig, axes = plt.subplots(
        rows_n, cols, figsize=(12, sum(0.4 * h + 1.2 for h in heights)), gridspec_kw={"height_ratios": [max(h, 4) for h in heights]}
    )
    cells = list(axes.flat)
    for ax, scenario in zip(cells, shown, strict=False):
        rows = summary[scenario.key]
        names = list(rows)
        values = [rows[n]["median"] for n in names]
        finite = [v for v in values if v == v and v > 0]
        spread = max(finite) / min(finite) if finite else 1.0
        ys = range(len(names))
        ax.barh(ys, [v if v == v else 0 for v in values], color=[COLORS.get(n, "#999999") for n in names], height=0.7)
        ax.set_yticks(list(ys), names, fontsize=11)
        for label in ax.get_yticklabels():
            if label.get_text() in REGISTERED:
                label.set_fontweight("bold")
        ax.invert_yaxis()
        if spread > 30:
            ax.set_xscale("log")
            low = min(finite) / 2
            ax.set_xlim(low, max(finite) * (max(finite) / low) ** 1.5)  # the longest bar 2/5 wide: its text fits right of it
        elif finite:
            ax.set_xlim(0, max(finite) * 2.6)
        for y, name, v in zip(ys, names, values, strict=True):
            if v == v:
                ax.text(v, y, "  " + bar_label(rows[name], name, scenario.unit), va="center", fontsize=10)
        better = "higher is better" if scenario.higher_is_better else "lower is better"
        ax.set_title(f"{scenario.key}: {scenario.title}\n{scenario.unit}, {better}", fontsize=12, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    key = cells[len(shown)]
    key.axis("off")
    lines = [
        "Each bar: the median over rounds.",
        "Written on it: the median, then how many times",
        "better than torch with the same strategy",
        "(torch-fd / torch-fs; > 1 is better, either direction).",
        "Bold: shmreduce registered. Log scale where",
        "a panel spans more than 30x.",
    ]
    if meta:
        lines += [
            "",
            f"{date}: {meta['nproc']} cores, Python {meta['python']},",
            f"torch {meta['torch']}, start method {meta['start_method']}",
        ]
    key.text(0.0, 1.0, "\n".join(lines), va="top", fontsize=11, transform=key.transAxes)
    for ax in cells[len(shown) + 1 :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary_line(summary: dict) -> str:
    """README's one line: shmreduce against torch with the same strategy, per scenario
    (``file_descriptor``, then ``file_system`` where it has a row)."""
    parts = []
    for scenario in SCENARIOS:
        rows = summary.get(scenario.key) or {}
        ratios = [rows[impl]["ratio"] for impl in ("shmreduce-fd", "shmreduce-fs") if impl in rows]
        ratios = [r for r in ratios if r == r]
        if ratios:
            peer = "" if any(impl.startswith("torch") for impl in rows) else " (against by value)"
            parts.append(f"{scenario.title} **{' / '.join(fmt(r) + 'x' for r in ratios)}**{peer}")
    return "How many times better than torch with the same strategy (fd / fs): " + "; ".join(parts) + "."


def replace_marked(path: Path, body: str) -> None:
    """Rewrite *path* between the bench markers; a file without them is left as it is."""
    text = path.read_text() if path.exists() else ""
    if MARK_START not in text or MARK_END not in text:
        print(f"warning: {path} has no {MARK_START} / {MARK_END} markers; left unchanged", file=sys.stderr)
        return
    pattern = re.compile(re.escape(MARK_START) + ".*?" + re.escape(MARK_END), re.S)
    path.write_text(pattern.sub(lambda _: MARK_START + body + MARK_END, text, count=1))
    print(f"updated {path}")


def update_readme(summary: str, table: str, holding: str, command: str, meta: dict, date: str, mechanism: str = "") -> None:
    """README.md gets one line and the chart; docs/benchmarks.md the full tables."""
    where = (
        f"`{command}` on {date}; {meta['nproc']} cores, Python {meta['python']}, torch {meta['torch']}, "
        f"start method {meta['start_method']}.\n"
    )
    cost = f"\nThe mechanism's own cost, CPU per message (`benchmarks/mechanism.py`):\n\n{mechanism}\n" if mechanism else ""
    replace_marked(README, f"\n{summary}\n\n![benchmark chart](benchmarks/results/chart.png)\n\n{where}")
    replace_marked(BENCH_DOC, f"\n{table}\n\n{holding}\n{cost}\n![benchmark chart](../benchmarks/results/chart.png)\n\n{where}")


def render(stored: dict, out: Path, update: bool) -> None:
    """The chart and the tables from results as main() stores them (results.json)."""
    summary, goals, meta, date = stored["summary"], stored["goals"], stored["machine"], stored["date"]
    draw_chart(summary, out / "chart.png", meta, date)
    print(f"wrote {out / 'chart.png'}")
    if update:
        cost = "\n".join(mechanism.table(stored["mechanism"])) if stored.get("mechanism") else ""
        update_readme(summary_line(summary), markdown_table(summary, goals), holding_table(summary), stored["command"], meta, date, cost)
