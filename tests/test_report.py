"""The run report draws readable pictures from metrics.jsonl and timeline.jsonl, and says which line is broken."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from openrlhf_async.cli.report import main
from openrlhf_async.trainer.report import write_report

T0 = 1.7e9  # spans are time.time() seconds
# matplotlib's tab: colours, as the report draws them: reward/generate, eval/train, sync, pass@k/eval, other kinds
BLUE, ORANGE, RED, GREEN, PURPLE = (31, 119, 180), (255, 127, 14), (214, 39, 40), (44, 160, 44), (148, 103, 189)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def span(actor, kind, start, end, step=0):
    return {"actor": actor, "kind": kind, "start": T0 + start, "end": T0 + end, "step": step}


def realistic_run(run_dir, steps=10):
    """A one-step-off async run: the engines generate batch s+1 while the ranks train on batch s, pause for the
    weight sync, and evaluate before training and every 5 steps. Engine 1 finishes each batch 0.8 s early."""
    metrics = [{"step": 0, "eval/accuracy": 0.30, "eval/mean@4": 0.30, "eval/pass@4": 0.55, "weight_version": 0}]
    spans = [span(a, "eval", 0, 3) for a in ("generator", "engine 0", "engine 1")]
    spans += [span("trainer", "wait", 3, 9, 1), span("generator", "generate", 3, 9, 1),
              span("engine 0", "generate", 3, 9, 1), span("engine 1", "generate", 3, 8, 1)]
    clock = 9.0
    for step in range(1, steps + 1):
        for actor in ("trainer", "rank 0", "rank 1"):
            spans.append(span(actor, "train", clock, clock + 5, step))
        for actor in ("trainer", "rank 0", "engine 0", "engine 1"):
            spans.append(span(actor, "sync", clock + 5, clock + 5.8, step))
        ready = clock + (7 if step < steps else 5.8)  # the last step has no next batch to wait for
        if step < steps:
            spans.append(span("generator", "generate", clock, ready, step + 1))
            for actor, early in (("engine 0", 0), ("engine 1", 0.8)):
                spans += [span(actor, "generate", clock, clock + 5, step + 1),
                          span(actor, "generate", clock + 5.8, ready - early, step + 1)]
        row = {"step": step, "reward/mean": 0.2 + 0.05 * step, "rollout/response_len_mean": 300 - 8 * step}
        if step % 5 == 0:
            for actor in ("generator", "engine 0", "engine 1"):
                spans.append(span(actor, "eval", ready, ready + 2, step))
            ready += 2
            row.update({"eval/accuracy": 0.3 + 0.04 * step, "eval/mean@4": 0.3 + 0.04 * step,
                        "eval/pass@4": 0.55 + 0.03 * step})
        metrics.append(row)
        if step < steps:
            spans.append(span("trainer", "wait", clock + 5.8, ready, step + 1))
        clock = ready
    write_jsonl(os.path.join(run_dir, "metrics.jsonl"), metrics)
    write_jsonl(os.path.join(run_dir, "timeline.jsonl"), spans)


def png_colours(path, size) -> set:
    """The colours of a PNG of the given pixel size: what was drawn."""
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == size
        return {colour for _, colour in img.convert("RGB").getcolors(maxcolors=1 << 24)}


def test_realistic_run_writes_both_pictures(tmp_path):
    realistic_run(tmp_path)
    report = write_report(str(tmp_path))
    assert report["learning_png"] == str(tmp_path / "learning.png")
    assert report["timeline_png"] == str(tmp_path / "timeline.png")
    assert report["steps"] == 10
    assert list(report["busy"]) == ["trainer", "rank 0", "rank 1", "generator", "engine 0", "engine 1"]
    # The run lasts 81.8 s (3 s eval, 6 s first batch, 9 steps of 7 s, a last 5.8 s step, two 2 s evals).
    assert report["busy"]["rank 1"] == pytest.approx(50 / 81.8, abs=1e-3)
    assert report["busy"]["engine 0"] > report["busy"]["engine 1"] > report["busy"]["rank 1"]
    assert {BLUE, ORANGE, GREEN} <= png_colours(report["learning_png"], (1200, 480))  # reward, accuracy, pass@4
    assert {BLUE, ORANGE, RED, GREEN} <= png_colours(report["timeline_png"], (1200, 480))


def test_busy_share_is_the_union_of_work_spans(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}])
    write_jsonl(tmp_path / "timeline.jsonl", [
        span("engine 0", "generate", 0, 5), span("engine 0", "generate", 3, 8),  # overlap counts once
        span("engine 0", "eval", 4, 6),
        span("trainer", "wait", 0, 10), span("trainer", "train", 2, 4),  # waiting is not busy
        span("rank 10", "train", 2, 3), span("rank 2", "train", 2, 4),
        span("zeta", "mystery", 9, 10),  # an unknown kind still draws
    ])
    report = write_report(str(tmp_path))
    assert list(report["busy"].items()) == [("trainer", 0.2), ("rank 2", 0.2), ("rank 10", 0.1), ("engine 0", 0.8),
                                            ("zeta", 0.1)]
    assert PURPLE in png_colours(report["timeline_png"], (1200, 432))


@pytest.mark.parametrize("timeline", [None, []], ids=["no timeline file", "empty timeline file"])
def test_run_without_timeline_or_eval_writes_only_learning(tmp_path, timeline):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5, "loss": 0.1}])
    if timeline is not None:
        write_jsonl(tmp_path / "timeline.jsonl", timeline)
    report = write_report(str(tmp_path))
    assert report == {"learning_png": str(tmp_path / "learning.png"), "timeline_png": None, "busy": {},
                      "steps": 1}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["learning.png"]
    colours = png_colours(report["learning_png"], (1200, 480))
    assert BLUE in colours and ORANGE not in colours  # a reward line, no eval line


def test_cli_prints_paths_then_json(tmp_path):
    realistic_run(tmp_path, steps=3)
    done = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.report", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [str(tmp_path / "learning.png"), str(tmp_path / "timeline.png")]
    assert json.loads(lines[-1])["steps"] == 3


def run_cli_error(capsys, run_dir) -> str:
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_cli_errors_name_the_file(tmp_path, capsys):
    assert "metrics.jsonl: no such file" in run_cli_error(capsys, tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert "metrics.jsonl: no metrics lines" in run_cli_error(capsys, tmp_path)
    assert "no such run folder" in run_cli_error(capsys, tmp_path / "missing")


def test_cli_errors_name_the_malformed_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew\n')
    assert "metrics.jsonl: line 2 is not valid JSON" in run_cli_error(capsys, tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    no_end = {"actor": "engine 0", "kind": "generate", "start": T0, "step": 1}
    spans = [span("engine 0", "generate", 0, 1), span("trainer", "train", 0, 1), no_end]
    write_jsonl(tmp_path / "timeline.jsonl", spans)
    err = run_cli_error(capsys, tmp_path)
    assert "timeline.jsonl: line 3 does not have actor (str), kind (str), start (number), end (number)" in err
    assert not list(tmp_path.glob("*.png")), "a broken log draws nothing"
