"""A run's pictures, drawn from <run dir>/metrics.jsonl and timeline.jsonl: learning.png (reward/mean per step, eval
accuracy and pass@k where evaluated) and timeline.png (a row per actor, a bar per span coloured by kind, each row
labelled with its busy share, so idle time and async overlap show at a glance). The trainer draws them at the end of
a run; `python -m openrlhf_async.cli.report <run_dir>` draws them again."""

import os
import re

KIND_COLOURS = {"generate": "tab:blue", "train": "tab:orange", "sync": "tab:red", "eval": "tab:green",
                "checkpoint": "tab:brown", "wait": "lightgrey"}
OTHER_KIND_COLOUR = "tab:purple"  # any kind not above
ROW_GROUPS = ["trainer", "rank", "generator", "engine"]  # top to bottom: consumers above producers
METRICS_FIELDS = {"step": int}
SPAN_FIELDS = {"actor": str, "kind": str, "start": (int, float), "end": (int, float)}


def read_jsonl(path: str, fields: dict) -> list:
    """The objects of a JSON-lines file, each with the {name: type} fields. A bad line is a one-line ValueError
    naming the file and line, so a broken log says where it broke."""
    from openrlhf_async.data.prompts import json_lines

    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    want = ", ".join(f"{k} ({t.__name__ if isinstance(t, type) else 'number'})" for k, t in fields.items())

    def check(row):
        if not (isinstance(row, dict) and all(isinstance(row.get(k), t) for k, t in fields.items())):
            return f"does not have {want}"
        return None

    with open(path, encoding="utf-8") as f:
        return json_lines(f, path, check)


def row_key(actor: str):
    """trainer, rank N, generator, engine N (numbers in numeric order), then other names alphabetically."""
    name, _, number = actor.partition(" ")
    if name in ("rank", "engine") and number.isdigit():
        return (ROW_GROUPS.index(name), int(number), "")
    return (ROW_GROUPS.index(actor), 0, "") if actor in ROW_GROUPS else (len(ROW_GROUPS), 0, actor)


def busy_seconds(intervals) -> float:
    """Length of the union of (start, end) intervals: overlapping work on one actor counts once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def busy_shares(spans: list) -> dict:
    """{actor: share of the timeline (earliest start to latest end, all actors) in non-"wait" spans}, in row order."""
    length = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    work = {a: [] for a in sorted({s["actor"] for s in spans}, key=row_key)}
    for s in spans:
        if s["kind"] != "wait":
            work[s["actor"]].append((s["start"], s["end"]))
    return {a: busy_seconds(w) / length if length > 0 else 0.0 for a, w in work.items()}


def series(records: list, key: str):
    rows = [r for r in records if isinstance(r.get(key), (int, float))]
    return [r["step"] for r in rows], [r[key] for r in rows]


def sample_counts(keys, name: str) -> list:
    """The k > 1 of the eval/<name>@k keys; at k = 1 mean and pass equal the accuracy and add nothing."""
    found = (re.fullmatch(rf"eval/{name}@(\d+)", key) for key in keys)
    return sorted(int(m[1]) for m in found if m and int(m[1]) > 1)


def plot_learning(records: list, path: str):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = {k for r in records for k in r}
    has_len = "rollout/response_len_mean" in keys
    fig, axes = plt.subplots(1, 2 if has_len else 1, figsize=(10, 4), dpi=120, squeeze=False,
                             width_ratios=[3, 1.3] if has_len else [1], layout="constrained")
    ax = axes[0][0]
    steps, rewards = series(records, "reward/mean")
    if len(steps) > 30:  # a noisy curve: drawn faint, with its running mean on top to show the trend
        window = len(steps) // 15
        ax.plot(steps, rewards, color="C0", alpha=0.3, linewidth=1)
        ax.plot(steps[window - 1:], [sum(rewards[i - window:i]) / window for i in range(window, len(steps) + 1)],
                color="C0", label=f"reward/mean (train, mean of {window} steps)")
    elif steps:
        ax.plot(steps, rewards, "o-", color="C0", markersize=4, label="reward/mean (train)")
    all_steps, all_scores = series(records, "rollout/score_all_mean")
    if all_steps:
        ax.plot(all_steps, all_scores, ".-", color="C4", markersize=3, linewidth=1,
                label="score of every finished group (train, before the filter)")
    mean_k = sample_counts(keys, "mean")
    evals = [("eval/accuracy", "s--", f"eval accuracy (mean@{mean_k[0]})" if mean_k else "eval accuracy")]
    evals += [(f"eval/pass@{k}", "^:", f"eval pass@{k}") for k in sample_counts(keys, "pass")]
    for colour, (key, style, label) in enumerate(evals, 1):
        x, y = series(records, key)
        if x:
            ax.plot(x, y, style, color=f"C{colour}", markersize=6, label=label)
    ax.set(title="Reward and eval accuracy", xlabel="training step (0 = before training)", ylabel="score")
    if ax.lines:
        ax.legend(loc="best", fontsize="small")
    if has_len:
        x, y = series(records, "rollout/response_len_mean")
        axes[0][1].plot(x, y, "o-" if len(x) <= 30 else "-", color="tab:gray", markersize=3)
        axes[0][1].set(title="Mean response length", xlabel="training step", ylabel="tokens")
    first, last = min(r["step"] for r in records), max(r["step"] for r in records)
    pad = max(1, 0.03 * (last - first))  # a one-step run still gets whole-step ticks
    for a in axes[0]:
        a.set_xlim(first - pad, last + pad)
        a.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        a.grid(alpha=0.3)
    fig.savefig(path)
    plt.close(fig)


def plot_timeline(spans: list, busy: dict, path: str):
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    origin = min(s["start"] for s in spans)
    actors = list(busy)
    present = {s["kind"] for s in spans}
    kinds = [k for k in KIND_COLOURS if k in present] + sorted(present - set(KIND_COLOURS))
    colours = {k: KIND_COLOURS.get(k, OTHER_KIND_COLOUR) for k in kinds}
    fig, ax = plt.subplots(figsize=(10, max(3.0, 1.6 + 0.4 * len(actors))), dpi=120, layout="constrained")
    for row, actor in enumerate(actors):
        # Wait spans go first so work drawn over them stays visible.
        for kind in sorted(kinds, key=lambda k: k != "wait"):
            bars = [(s["start"] - origin, s["end"] - s["start"]) for s in spans
                    if s["actor"] == actor and s["kind"] == kind]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=colours[kind], linewidth=0, snap=False)
    handles = [Patch(color=colours[k], label=k) for k in kinds]
    syncs = [s["start"] - origin for s in spans if s["actor"] == "trainer" and s["kind"] == "sync"]
    if 0 < len(syncs) <= 50:  # a line per weight version; more would grey out the picture
        for x in syncs:
            ax.axvline(x, color="black", linestyle=":", linewidth=0.8, alpha=0.6)
        handles.append(Line2D([], [], color="black", linestyle=":", label="weight sync (new version)"))
    ax.set_yticks(range(len(actors)), [f"{a} ({busy[a]:.0%} busy)" for a in actors])
    ax.set_ylim(len(actors) - 0.5, -0.5)  # first actor on top
    ax.set_xlim(0, max(s["end"] for s in spans) - origin)
    ax.set_xlabel("seconds since the run's first span")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)  # grid lines behind the bars
    fig.suptitle("Actor timeline (blank = idle)")
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1), ncol=min(len(handles), 6), frameon=False)
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: str) -> dict:
    """Write learning.png (and timeline.png when timeline.jsonl has spans) into run_dir; the trainer calls this
    at the end of a run. Returns {"learning_png", "timeline_png" (None without a timeline), "busy", "steps"}."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir}: no such run folder")
    metrics_path, timeline_path = (os.path.join(run_dir, name) for name in ("metrics.jsonl", "timeline.jsonl"))
    records = read_jsonl(metrics_path, METRICS_FIELDS)
    if not records:
        raise ValueError(f"{metrics_path}: no metrics lines (did the run log a step?)")
    spans = read_jsonl(timeline_path, SPAN_FIELDS) if os.path.isfile(timeline_path) else []
    report = {"learning_png": os.path.join(run_dir, "learning.png"), "timeline_png": None, "busy": {},
              "steps": max(r["step"] for r in records)}
    plot_learning(records, report["learning_png"])
    if spans:
        busy = busy_shares(spans)
        report["timeline_png"] = os.path.join(run_dir, "timeline.png")
        report["busy"] = {actor: round(share, 3) for actor, share in busy.items()}
        plot_timeline(spans, busy, report["timeline_png"])
    return report
