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
    """`make gpu-e2e`'s driver with its planted-fault run: three steps, the third transfer's buckets left unloaded. The
    first two checks pass (log-probs within the dtype's tolerance, the new weights moving them by more than it), the
    third fails, and the summary says the fault was caught. Ray cannot be imported, as on the GPU machines."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no Ray here, as on the GPU machines')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_e2e.py"), "--device", "cpu",
                           "--runs", "fault", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert len(lines) == 2, proc.stdout[-3000:] + (out / "fault.log").read_text()[-3000:]
    result, summary = lines
    assert [json.loads(line) for line in (out / "gpu_e2e.jsonl").read_text().splitlines()] == [result]
    assert proc.returncode == 0 and summary["fault_caught"] is True and summary["runners"] == {"fault": "v1"}
    assert result["ok"] is False and result["run"] == "fault" and result["model_runner"] == "v1"
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


def _site(folder, sizes):
    """A folder like the kit's (packages in subfolders), of random bytes: {relative path: bytes}."""
    made = {}
    for i, size in enumerate(sizes):
        rel = os.path.join(f"pkg{i}", "sub", f"mod{i}.so")
        os.makedirs(os.path.join(folder, os.path.dirname(rel)), exist_ok=True)
        data = os.urandom(size)
        with open(os.path.join(folder, rel), "wb") as f:
            f.write(data)
        made[rel] = data
    return made


def test_the_kit_travels_in_checked_pieces_and_unpacks_only_once_all_are_there(tmp_path, capsys):
    made = _site(tmp_path / "site", [2500, 700, 4100])  # random bytes: xz cannot shrink them
    kit, dest = tmp_path / "kit", tmp_path / "dest"
    manifest = gpu_kit.pack(str(tmp_path / "site"), str(kit), piece_bytes=3000)
    pieces = manifest["pieces"]
    assert len(pieces) >= 3 and all(p["bytes"] <= 3000 for p in pieces)
    assert manifest["files"] == len(made)

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
            assert status == 0 and "the packages are ready" in out, out
    for rel, data in made.items():
        assert (dest / "site" / rel).read_bytes() == data
    assert sorted(os.listdir(dest)) == ["site"], "only the unpacked folder stays"
    assert gpu_kit.stage(str(carried), str(dest)) == 0, "a later call finds it ready"


def test_a_damaged_piece_is_refused_by_its_digest(tmp_path, capsys):
    _site(tmp_path / "site", [5000])
    kit = tmp_path / "kit"
    manifest = gpu_kit.pack(str(tmp_path / "site"), str(kit), piece_bytes=2048)
    damaged = kit / manifest["pieces"][1]["name"]
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert gpu_kit.stage(str(kit), str(tmp_path / "dest")) == 1
    out = capsys.readouterr().out
    assert f"{manifest['pieces'][1]['name']} does not match its digest" in out and "make gpu-e2e-kit" in out
    assert not (tmp_path / "dest" / "site").exists()


def _hostile_manifest(kit, pieces):
    os.makedirs(kit, exist_ok=True)
    with open(os.path.join(kit, "manifest.json"), "w") as f:
        json.dump({"archive_sha256": "0" * 64, "pieces": pieces, "wheels": ["x.whl"]}, f)  # "wheels": as 090a44e read it


def _digest(path):
    return {"bytes": os.path.getsize(path), "sha256": gpu_kit.sha256(str(path))}


def test_a_manifest_naming_pieces_outside_its_folder_writes_and_removes_nothing_there(tmp_path, capsys):
    """A piece named ../ESCAPED would be copied beside DEST; one named by an absolute path whose size and digest the
    attacker knows would count as present and be removed after unpacking. Both are refused before anything is
    written, in one line."""
    kit, dest = tmp_path / "kit" / "carried", tmp_path / "work" / "dest"
    kit.mkdir(parents=True)
    payload = tmp_path / "kit" / "ESCAPED"  # what ../ESCAPED names from the carried folder
    payload.write_bytes(b"payload")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    for name, source in (("../ESCAPED", payload), (str(victim), victim)):
        _hostile_manifest(kit, [{"name": name, **_digest(source)}])
        assert gpu_kit.stage(str(kit), str(dest)) == 1
        out = capsys.readouterr().out
        assert "refused" in out and "pieces are named piece-NN" in out and out.count("\n") == 1, out
    assert victim.read_text() == "the user's own file\n"
    assert not (tmp_path / "work" / "ESCAPED").exists() and not dest.exists()


def _tar_with(path, add):
    import io
    import tarfile

    with tarfile.open(path, "w:xz") as tar:
        add(tar, io, tarfile)


def _kit_of_archive(tmp_path, archive):
    """A kit whose one piece is `archive`, with a manifest whose digests match it (the attacker writes both)."""
    kit = tmp_path / "kit"
    os.makedirs(kit, exist_ok=True)
    data = open(archive, "rb").read()
    (kit / "piece-00").write_bytes(data)
    digest = gpu_kit.sha256(str(kit / "piece-00"))
    with open(kit / "manifest.json", "w") as f:
        json.dump({"archive_sha256": digest, "wheels": ["x.whl"],
                   "pieces": [{"name": "piece-00", "bytes": len(data), "sha256": digest}]},
                  f)
    return kit


def _file(tar, io, tarfile, name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _link(tar, tarfile, name, target, kind=None):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind or tarfile.SYMTYPE, target
    tar.addfile(info)


@pytest.mark.parametrize("attack", ["upward", "absolute", "symlink", "hardlink", "symlink_then_file",
                                    "path_max_symlinks", "device"])
def test_a_hostile_archive_writes_nothing_outside_its_folder(tmp_path, capsys, attack):
    """The archive's members are checked by the kit itself: plain files and folders only, each path inside DEST/site
    once resolved. The PATH_MAX chain is the shape of CVE-2025-4517, which tarfile's "data" filter of Python 3.11.7
    lets through (the public proof of concept's shape): folders of 247-character names with one-letter links to
    them, a link past PATH_MAX back up, then a link out of DEST that the filter's realpath cannot resolve."""
    outside = tmp_path / "outside"
    outside.mkdir()
    escape_to = str(outside / "ESCAPED")

    def add(tar, io, tarfile):
        _file(tar, io, tarfile, "ok/first.py")
        if attack == "upward":
            _file(tar, io, tarfile, "../../outside/ESCAPED")
        elif attack == "absolute":
            _file(tar, io, tarfile, escape_to)
        elif attack == "symlink":
            _link(tar, tarfile, "ok/ESCAPED", escape_to)
        elif attack == "hardlink":
            _link(tar, tarfile, "ok/ESCAPED", escape_to, tarfile.LNKTYPE)
        elif attack == "symlink_then_file":
            _link(tar, tarfile, "ok/out", str(outside))
            _file(tar, io, tarfile, "ok/out/ESCAPED")
        elif attack == "path_max_symlinks":
            steps, path = "abcdefghijklmnop", ""
            for step in steps:
                info = tarfile.TarInfo(os.path.join(path, "d" * 247))
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                _link(tar, tarfile, os.path.join(path, step), "d" * 247)
                path = os.path.join(path, "d" * 247)
            up = "/".join(steps) + "/" + "l" * 254
            _link(tar, tarfile, up, "../" * len(steps))
            _link(tar, tarfile, "escape", up + "/.." * len(steps) + "/" + str(outside)[1:])
            _file(tar, io, tarfile, "escape/ESCAPED")
        else:
            info = tarfile.TarInfo("ok/dev")
            info.type = tarfile.CHRTYPE
            tar.addfile(info)

    archive = tmp_path / "evil.tar.xz"
    _tar_with(archive, add)
    kit, dest = _kit_of_archive(tmp_path, archive), tmp_path / "dest"
    assert gpu_kit.stage(str(kit), str(dest)) == 1
    out = capsys.readouterr().out
    assert "refused" in out and out.count("\n") == 1, out
    assert os.listdir(outside) == [], "nothing written outside DEST"
    assert not os.path.exists(escape_to)
    assert not (dest / "site" / ".kit-sha256").exists(), "a refused kit is never marked ready"


def test_an_archive_that_unpacks_past_its_bound_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_kit, "MAX_UNPACKED_BYTES", 10_000)
    _tar_with(tmp_path / "big.tar.xz", lambda tar, io, tarfile: _file(tar, io, tarfile, "big", b"\0" * 20_000))
    kit = _kit_of_archive(tmp_path, tmp_path / "big.tar.xz")
    assert gpu_kit.stage(str(kit), str(tmp_path / "dest")) == 1
    assert "more than" in capsys.readouterr().out


def test_every_call_of_the_kit_fits_the_device_limit_with_the_tree_beside_it():
    """A piece, the manifest and the repository's tree (tracked files and untracked ones not ignored, which travel
    with every device call) stay under CALL_LIMIT; the kit of 090a44e cut 56 MiB pieces, which made 65.9 MiB calls."""
    tree = gpu_kit.travelling_bytes()
    assert tree > 1 << 20, "the tree was measured"
    assert gpu_kit.PIECE_BYTES + tree + gpu_kit.MANIFEST_ALLOWANCE <= gpu_kit.CALL_LIMIT, \
        f"a call would carry {(gpu_kit.PIECE_BYTES + tree) / 2**20:.1f} MiB"
    kit = {"pieces": [{"bytes": gpu_kit.PIECE_BYTES}] * gpu_kit.MAX_CALLS}
    assert gpu_kit.calls_of(kit, tree)["fits"]
    assert not gpu_kit.calls_of({"pieces": kit["pieces"] * 2}, tree)["fits"], "more calls than planned"


def test_a_run_that_imports_what_the_kit_dropped_is_named_in_one_line():
    manifest = {"dropped_patterns": gpu_kit.DROPPED}
    line = gpu_kit.dropped_import("Traceback ...\nModuleNotFoundError: No module named 'vllm._qutlass_C'\n", manifest)
    assert "vllm._qutlass_C" in line and "leaves out" in line and "\n" not in line
    line = gpu_kit.dropped_import("ModuleNotFoundError: No module named 'vllm.third_party.deep_gemm'", manifest)
    assert "leaves out" in line and "FP8" in line
    assert "not in the kit" in gpu_kit.dropped_import("No module named 'pydantic'", manifest)
    assert gpu_kit.dropped_import("RuntimeError: CUDA out of memory", manifest) == ""


@pytest.mark.parametrize("missing", ["manifest", "pieces"])
def test_without_the_packages_or_the_kit_the_harness_says_what_to_run(tmp_path, monkeypatch, capsys, missing):
    from benchmarks import gpu_e2e

    monkeypatch.setattr(gpu_e2e, "REQUIRED", ("deepspeed", "no_such_package_gpu_e2e"))
    kit = tmp_path / "kit"
    if missing == "pieces":  # a manifest whose pieces never came
        _site(tmp_path / "site", [100])
        gpu_kit.pack(str(tmp_path / "site"), str(kit))
        os.remove(kit / "piece-00")
    assert gpu_e2e.main(["--device", "cpu", "--kit", str(kit), "--kit_dest", str(tmp_path / "dest")]) == 2
    out = capsys.readouterr().out
    if missing == "pieces":
        assert "still to bring: piece-00" in out, out
    else:
        assert "no_such_package_gpu_e2e missing" in out and "make gpu-e2e-kit" in out, out
