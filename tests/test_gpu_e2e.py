"""`make gpu-e2e` on CPU (benchmarks/gpu_e2e.py on vLLM's CPU build): the hybrid engine's step order with a real
trainer rank and a real engine sharing the device, the weights sent through the run's own transfer, vLLM's tokens
and log-probs checked against the trainer's after each; and its kit (benchmarks/gpu_kit.py), the wheels in pieces
that travel one command each to a GPU machine without a network."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import gpu_kit  # noqa: E402


def test_the_harness_runs_the_hybrid_step_and_its_check_catches_an_engine_that_skipped_loading(tmp_path):
    """Three steps; the third transfer's buckets are left unloaded (a planted fault): the first two checks pass (log-
    probs within the dtype's tolerance, the new weights moving them by more than it), the third fails, and so does
    the run. Ray cannot be imported, as on the GPU machines."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no Ray here, as on the GPU machines')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_e2e.py"), "--device", "cpu",
                           "--steps", "3", "--fault_at_step", "3"], capture_output=True, text=True, cwd=ROOT, env=env)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert proc.returncode == 1 and result["ok"] is False
    assert result["device"] == "cpu" and result["shape"] == "tiny" and result["params"] > 0
    first, second, planted = result["checks"]
    for check in (first, second):
        assert check["ok"], check
        assert check["max_logprob_diff"] <= check["tolerance"] < check["moved"]
        assert check["tokens_wrong"] == 0 and check["versions_ok"] and check["groups_differing"] == 0
    assert not planted["ok"] and planted["max_logprob_diff"] > planted["tolerance"], planted
    assert planted["groups_differing"] > 0, "the sync check (fingerprints) sees the unloaded buckets too"
    order = ["generate", "sleep", "reload", "train", "offload", "wake weights", "transfer", "wake kv_cache"]
    for step in result["steps"]:
        assert list(step) == order
        assert all(step[phase]["s"] >= 0 and step[phase]["used_gb"] > 0 for phase in order)
        assert step["transfer"]["buckets"] >= 1 and step["train"]["grad_norm"] > 0
    assert result["planned_gb"]["trainer_rank"] > 0 and result["planned_gb"]["vllm_engine"] > 0


def _wheels(folder, sizes):
    os.makedirs(folder, exist_ok=True)
    made = {}
    for i, size in enumerate(sizes):
        name = f"pkg{i}-1.0-py3-none-any.whl"
        data = os.urandom(size)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        made[name] = data
    return made


def test_the_kit_travels_in_checked_pieces_and_unpacks_only_once_all_are_there(tmp_path, capsys):
    made = _wheels(tmp_path / "wheels", [2500, 700, 4100])
    kit, dest = tmp_path / "kit", tmp_path / "dest"
    manifest = gpu_kit.pack(str(tmp_path / "wheels"), str(kit), piece_bytes=3000)
    pieces = manifest["pieces"]
    assert len(pieces) >= 3 and all(p["bytes"] <= 3000 for p in pieces)
    assert sorted(manifest["wheels"]) == sorted(made)

    # One piece per command: the others are not in the repository's copy then.
    carried = tmp_path / "carried"
    for k, piece in enumerate(pieces):
        os.makedirs(carried, exist_ok=True)
        for name in os.listdir(carried):
            os.remove(carried / name)
        (carried / "manifest.json").write_bytes((kit / "manifest.json").read_bytes())
        (carried / piece["name"]).write_bytes((kit / piece["name"]).read_bytes())
        status = gpu_kit.stage(str(carried), str(dest))
        out = capsys.readouterr().out
        if k < len(pieces) - 1:
            assert status == 3 and f"{k + 1} of {len(pieces)} pieces" in out, out
            assert pieces[-1]["name"] in out
        else:
            assert status == 0 and "the wheels are ready" in out, out
    for name, data in made.items():
        assert (dest / "wheels" / name).read_bytes() == data
    assert not [n for n in os.listdir(dest) if n.startswith("piece-")], "the pieces were not cleared"


def test_a_damaged_piece_is_refused_by_its_digest(tmp_path, capsys):
    _wheels(tmp_path / "wheels", [5000])
    kit = tmp_path / "kit"
    manifest = gpu_kit.pack(str(tmp_path / "wheels"), str(kit), piece_bytes=2048)
    damaged = kit / manifest["pieces"][1]["name"]
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert gpu_kit.stage(str(kit), str(tmp_path / "dest")) == 1
    out = capsys.readouterr().out
    assert f"{manifest['pieces'][1]['name']} does not match its digest" in out and "make gpu-e2e-kit" in out
    assert not (tmp_path / "dest" / "wheels").exists()


@pytest.mark.parametrize("missing", ["manifest", "wheels"])
def test_without_the_packages_or_the_kit_the_harness_says_what_to_run(tmp_path, monkeypatch, capsys, missing):
    from benchmarks import gpu_e2e

    monkeypatch.setattr(gpu_e2e, "REQUIRED", ("deepspeed", "no_such_package_gpu_e2e"))
    kit = tmp_path / "kit"
    if missing == "wheels":  # a manifest whose pieces never came
        _wheels(tmp_path / "wheels", [100])
        gpu_kit.pack(str(tmp_path / "wheels"), str(kit))
        os.remove(kit / "piece-00")
    assert gpu_e2e.main(["--device", "cpu", "--kit", str(kit), "--kit_dest", str(tmp_path / "dest")]) == 2
    out = capsys.readouterr().out
    if missing == "wheels":
        assert "still to bring: piece-00" in out, out
    else:
        assert "no_such_package_gpu_e2e missing" in out and "make gpu-e2e-kit" in out, out

