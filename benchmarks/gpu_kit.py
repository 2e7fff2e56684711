"""What `make gpu-e2e` needs on a GPU machine that has torch and transformers but no vLLM, no DeepSpeed and no network,
in at most MAX_CALLS pieces that each travel with one device call. A call carries at most 64 MiB, and the
repository's tree travels with every call (about 10 MiB), so a piece is at most PIECE_BYTES: a call stays under
CALL_LIMIT (60 MiB) with the tree and the manifest beside it. What a call writes outside the repository stays only
while the machine is warm (30 s after a call), so the two calls go back to back (docs/BENCHMARKS.md, make gpu-e2e).

    prepare FOLDER     (here, with a network) download vLLM's CUDA build at the release the GPU machine's torch runs
                       (VLLM), the small packages it and DeepSpeed import that the GPU image lacks (ONE_GPU, and what
                       they need), and DeepSpeed; install them here into one folder for the GPU machine's Python
                       (pip --target --no-deps --no-compile, its platform forced), leave out DROPPED, pack the folder
                       as one xz archive and cut it into pieces (FOLDER/piece-00, ...) named in FOLDER/manifest.json
                       with their SHA-256 and the whole archive's. Ends with one JSON line: calls, largest_call_mib,
                       kit_mib, the files dropped.
    stage FOLDER DEST  (there, once per call) copy the pieces found in FOLDER to DEST, each checked; once DEST holds
                       all, join them, check the archive's digest and unpack it into DEST/site, which the harness
                       puts first on the Python path (nothing is installed into the machine's own Python, and nothing
                       is byte-compiled ahead).

Exit status of stage: 0 when DEST/site is ready, 3 while pieces are missing, 1 on anything refused (a digest that
does not match, a manifest or archive that names anything outside DEST).

Staging trusts nothing it is handed: the manifest and the archive may come from someone else. A piece must be named
piece-NN (two digits), so that no name reaches outside DEST; the archive may hold only plain files and folders whose
paths stay inside DEST/site once resolved (checked here, member by member, not left to tarfile's filters, which
Python 3.11.7 lets through past PATH_MAX: CVE-2025-4517), at most MAX_UNPACKED_BYTES in all; files are created new
(O_EXCL, O_NOFOLLOW), never through an existing link. Only the piece files of DEST are removed after unpacking.

Left out of vLLM 0.26.0's wheel (DROPPED), each never loaded by one dense bf16 engine at tensor parallel 1 on a
Hopper GPU (read in its sources):
- vllm_flash_attn/_vllm_fa2_C.abi3.so (291 MiB): FlashAttention 2. flash_attn_interface.py imports it under
  try/except (FA2_AVAILABLE); on SM90 vLLM picks FA3 (vllm_flash_attn/__init__.py, get_flash_attn_version).
- _moe_C_stable_libtorch.abi3.so (45 MiB): the MoE kernels. platforms/cuda.py imports it under try/except, logging
  a warning; only fused-MoE layers call torch.ops._moe_C (the harness runs a dense Qwen2).
- _flashmla_C.abi3.so, _flashmla_extension_C.abi3.so, third_party/flashmla: MLA attention (DeepSeek-style models);
  v1/attention/ops/flashmla.py imports them under try/except.
- _qutlass_C.abi3.so: FP4 quantisation; _custom_ops.py asks hasattr(torch.ops, "_qutlass_C") first.
- third_party/deep_gemm (61 MiB with its CUDA headers) and third_party/fmha_sm100: FP8 GEMMs compiled at run time
  and Blackwell attention; imported only by FP8 and SM100 code paths (utils/deep_gemm.py checks has_deep_gemm).
- vllm-rs (41 MiB): the Rust front end, started only with VLLM_RUST_FRONTEND_PATH (envs.py).
- benchmarks/ and the OpenAI server's static files: neither is imported by an engine.
If vLLM imports one of them after all, benchmarks/gpu_e2e.py stops with one line naming it (dropped_import).

Left out as packages: whatever the GPU image already has (IMAGE: its package list, 2026-11-17; the first call
records the machine's own `pip list` to $OUT), and what vLLM declares but one engine without Ray never imports
(NOT_NEEDED, with why)."""

import argparse
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VLLM = "vllm==0.26.0"  # the release built for torch 2.11 and CUDA 13, what the GPU machines run
# What vLLM 0.26 imports to run one AsyncLLM engine (its engine core in a process of its own, one GPU, no Ray) that
# the GPU image lacks: found by importing its engine, worker, model runner, Qwen2 model, weight transfer and sleep
# allocator with each package removed in turn (2026-11-27), less the image's packages. Their own requirements are
# added by prepare (pydantic, jiter, ...). openai 2.x: 3.x would need httpx2 and httpcore2.
ONE_GPU = ("apache-tvm-ffi==0.1.10", "cachetools==8.0.2", "cbor2==6.3.0", "distro==1.9.0", "fastapi==0.136.3",
           "llguidance==1.7.6", "msgspec==0.22.0", "openai==2.54.0", "openai-harmony==0.0.8", "pybase64==1.5.1",
           "pyzmq==27.3.0", "sniffio==1.3.1", "starlette==1.10.0", "xgrammar==0.2.7")
DEEPSPEED = "deepspeed"  # at the version installed here, built into a pure-Python wheel (its ops compile on first use)
# The GPU machines' image ('cuda', its package list as read on 2026-11-17: the device tool's KINDS.md).
IMAGE = frozenset("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split())
# Declared by a kit package but not imported by one engine at tensor parallel 1 without Ray, nor by DeepSpeed's
# ZeRO-3 step (the removal test above; each stays out of the kit).
NOT_NEEDED = {
    **dict.fromkeys(("torch", "torchaudio", "torchvision", "torchcodec", "triton"), "the GPU machine's own build"),
    **dict.fromkeys(("flashinfer-python", "flashinfer-cubin", "tilelang", "nvidia-cutlass-dsl", "quack-kernels",
                     "tokenspeed-mla", "humming-kernels", "nvidia-cudnn-frontend", "fastsafetensors", "pynvvideocodec",
                     "nvtx"), "optional kernels vLLM looks for (gpu_e2e.py turns flashinfer's sampler off)"),
    **dict.fromkeys(("anthropic", "mcp", "model-hosting-container-standards", "prometheus-fastapi-instrumentator",
                     "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
                     "opentelemetry-semantic-conventions-ai", "watchfiles", "python-json-logger", "uvicorn",
                     "email-validator", "fastapi-cli", "python-multipart", "httptools", "websockets",
                     "python-dotenv", "jinja2-humanize-extension"), "the OpenAI server, which the harness does not start"),
    **dict.fromkeys(("lm-format-enforcer", "outlines-core", "lark", "partial-json-parser", "jsonschema", "ijson",
                     "mistral-common", "compressed-tensors", "depyf", "blake3", "setproctitle", "gguf"),
                    "structured outputs, tool parsing, quantised or Mistral checkpoints, images, torch.compile dumps"),
    "ray": "the harness runs without Ray, as the GPU machines have none",
}
MAX_CALLS = 2
CALL_LIMIT = 60 << 20  # the bound per call, under the device's 64 MiB
MANIFEST_ALLOWANCE = 64 << 10  # the manifest travels beside each piece
PIECE_BYTES = 45 << 20  # with the tree (about 10 MiB) and the manifest, a call stays under CALL_LIMIT
MAX_UNPACKED_BYTES = 2 << 30  # the kit unpacks to about 0.5 GiB: more is a hostile archive
ARCHIVE = "site.tar.xz"
PIECE_NAME = re.compile(r"piece-\d{2}")
DROPPED = (
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "FlashAttention 2: optional import, FA3 preferred on SM90"),
    ("vllm/_moe_C_stable_libtorch.abi3.so", "MoE kernels: import tolerated, dense model"),
    ("vllm/_flashmla_C.abi3.so", "MLA attention: optional import"),
    ("vllm/_flashmla_extension_C.abi3.so", "MLA attention: optional import"),
    ("vllm/third_party/flashmla/*", "MLA attention: optional import"),
    ("vllm/_qutlass_C.abi3.so", "FP4 quantisation: looked up with hasattr"),
    ("vllm/third_party/deep_gemm/*", "FP8 GEMMs: FP8 models only"),
    ("vllm/third_party/fmha_sm100/*", "Blackwell (SM100) attention"),
    ("vllm/vllm-rs", "the Rust front end: only with VLLM_RUST_FRONTEND_PATH"),
    ("vllm/benchmarks/*", "vLLM's benchmarks: not imported by an engine"),
    ("vllm/entrypoints/serve/instrumentator/static/*", "the server's Swagger page"),
    ("bin/*", "console scripts: the harness imports the packages"),
)


class KitRefused(Exception):
    """A manifest or archive that would write, or remove, outside DEST."""


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def travelling_bytes(root: str = ROOT) -> int:
    """What travels with every device call besides the carried kit: the repository's tracked files and the untracked
    ones git does not ignore."""
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    paths = {os.path.join(root, p) for p in out.decode().split("\0") if p}
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p))


def calls_of(manifest: dict, tree_bytes: int, manifest_bytes: int = MANIFEST_ALLOWANCE) -> dict:
    """The device calls the kit takes, one piece each, and the largest of them with what travels beside it."""
    largest = max((p["bytes"] for p in manifest["pieces"]), default=0) + tree_bytes + manifest_bytes
    return {"calls": len(manifest["pieces"]), "largest_call_mib": round(largest / 2**20, 2),
            "kit_mib": round(sum(p["bytes"] for p in manifest["pieces"]) / 2**20, 2),
            "fits": len(manifest["pieces"]) <= MAX_CALLS and largest <= CALL_LIMIT}


def cut(archive: str, folder: str, piece_bytes: int = PIECE_BYTES) -> list:
    """The archive in pieces of piece_bytes (the last shorter): [{name, bytes, sha256}]."""
    pieces = []
    with open(archive, "rb") as f:
        while True:
            data = f.read(piece_bytes)
            if not data:
                break
            name = f"piece-{len(pieces):02d}"
            with open(os.path.join(folder, name), "wb") as out:
                out.write(data)
            pieces.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return pieces


def pack(site: str, folder: str, piece_bytes: int = PIECE_BYTES, extra: dict = None) -> dict:
    """The folder `site` as one xz archive (paths relative to it), cut into pieces in folder, with the manifest
    written there; returns the manifest."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if PIECE_NAME.fullmatch(name) or name == "manifest.json":
            os.remove(os.path.join(folder, name))
    archive = os.path.join(folder, ARCHIVE)
    members = sorted(os.path.relpath(os.path.join(d, n), site) for d, _, files in os.walk(site) for n in files)
    if shutil.which("xz"):  # threaded: several times faster than Python's lzma on the 300 MiB of vLLM
        tar = subprocess.Popen(["tar", "-C", site, "--owner=0", "--group=0", "--numeric-owner", "-cf", "-",
                                "--no-recursion", "-T", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        with open(archive, "wb") as out:
            xz = subprocess.Popen(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=out)
            tar.stdout.close()
            tar.stdin.write("\n".join(members).encode() + b"\n")
            tar.stdin.close()
            if tar.wait() or xz.wait():
                raise RuntimeError("gpu-kit: tar | xz failed")
    else:
        with tarfile.open(archive, "w:xz", preset=9) as t:
            for name in members:
                t.add(os.path.join(site, name), arcname=name, recursive=False)
    unpacked = sum(os.path.getsize(os.path.join(site, m)) for m in members)
    manifest = {**(extra or {}), "files": len(members), "unpacked_bytes": unpacked,
                "archive_bytes": os.path.getsize(archive), "archive_sha256": sha256(archive),
                "pieces": cut(archive, folder, piece_bytes)}
    os.remove(archive)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(folder: str) -> dict:
    """The manifest, its piece names checked: each must be the kit's own (piece-NN), so none reaches outside DEST."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    pieces = manifest.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        raise KitRefused("the manifest names no pieces")
    for piece in pieces:
        name = piece.get("name") if isinstance(piece, dict) else None
        if not isinstance(name, str) or not PIECE_NAME.fullmatch(name):
            raise KitRefused(f"the manifest names a piece {name!r}: pieces are named piece-NN")
        if not isinstance(piece.get("bytes"), int) or not isinstance(piece.get("sha256"), str):
            raise KitRefused(f"the manifest's {name} has no size or digest")
    if len({p["name"] for p in pieces}) != len(pieces) or not isinstance(manifest.get("archive_sha256"), str):
        raise KitRefused("the manifest names a piece twice or has no archive digest")
    return manifest


def stage(folder: str, dest: str) -> int:
    """Copy the pieces in folder to dest, checked; join and unpack once all are there (see the module's doc)."""
    try:
        manifest = read_manifest(folder)
        return _stage(manifest, folder, dest)
    except KitRefused as e:
        print(f"gpu-kit: refused ({e}); nothing was written outside {dest}: use a kit made by `make gpu-e2e-kit`",
              flush=True)
        return 1


def _stage(manifest: dict, folder: str, dest: str) -> int:
    os.makedirs(dest, exist_ok=True)
    dest = os.path.realpath(dest)
    site = os.path.join(dest, "site")
    if _ready(site, manifest):
        print(f"gpu-kit: the packages are ready in {site}", flush=True)
        return 0
    for piece in manifest["pieces"]:
        source, target = os.path.join(folder, piece["name"]), os.path.join(dest, piece["name"])
        if os.path.isfile(source) and not _matches(target, piece):
            _remove(target)
            shutil.copyfile(source, target + ".part")
            os.replace(target + ".part", target)
            if not _matches(target, piece):
                os.remove(target)
                print(f"gpu-kit: {piece['name']} does not match its digest in the manifest (a different prepare, or "
                      "a damaged copy): run `make gpu-e2e-kit` again and bring its pieces", flush=True)
                return 1
    missing = [p["name"] for p in manifest["pieces"] if not _matches(os.path.join(dest, p["name"]), p)]
    if missing:
        print(f"gpu-kit: {len(manifest['pieces']) - len(missing)} of {len(manifest['pieces'])} pieces in {dest}; "
              f"still to bring: {' '.join(missing)}", flush=True)
        return 3
    archive = os.path.join(dest, ARCHIVE)
    _remove(archive)
    with open(archive, "xb") as out:
        for piece in manifest["pieces"]:
            with open(os.path.join(dest, piece["name"]), "rb") as f:
                shutil.copyfileobj(f, out)
    try:
        if sha256(archive) != manifest["archive_sha256"]:
            print("gpu-kit: the joined pieces do not match the archive's digest: run `make gpu-e2e-kit` again",
                  flush=True)
            return 1
        if os.path.lexists(site):
            shutil.rmtree(site) if os.path.isdir(site) and not os.path.islink(site) else os.remove(site)
        unpack(archive, site)
    finally:
        os.remove(archive)
    with open(os.path.join(site, ".kit-sha256"), "w") as f:
        f.write(manifest["archive_sha256"])
    for piece in manifest["pieces"]:  # the disk is the machine's: the unpacked folder alone stays
        os.remove(os.path.join(dest, piece["name"]))
    print(f"gpu-kit: the packages are ready in {site} ({manifest.get('files', '?')} files)", flush=True)
    return 0


def unpack(archive: str, into: str) -> None:
    """Unpack the archive's plain files and folders into `into`, each path checked to stay inside it once resolved;
    anything else (a link, a device, an absolute or upward path, too many bytes) refuses the whole archive."""
    os.makedirs(into)
    root = os.path.realpath(into)
    written = 0
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            target = _inside(root, member.name)
            if member.isdir():
                os.makedirs(target, mode=0o755, exist_ok=True)
                continue
            if not member.isreg():
                raise KitRefused(f"the archive holds {member.name!r}, which is not a plain file or folder")
            written += member.size
            if written > MAX_UNPACKED_BYTES:
                raise KitRefused(f"the archive unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB")
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            _inside(root, os.path.relpath(os.path.dirname(target), root))  # no link among the folders made
            mode = 0o755 if member.mode & 0o111 else 0o644
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out, tar.extractfile(member) as data:
                shutil.copyfileobj(data, out)


def _inside(root: str, name: str) -> str:
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or ".." in parts or len(name) > 1024 or any(len(p) > 255 for p in parts):
        raise KitRefused(f"the archive names {name[:200]!r}, a path outside its folder")
    target = os.path.join(root, *[p for p in parts if p not in ("", ".")])
    resolved = os.path.realpath(target)
    if resolved != root and not resolved.startswith(root + os.sep):
        raise KitRefused(f"the archive's {name[:200]!r} resolves outside its folder")
    return target


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)


def _ready(site: str, manifest: dict) -> bool:
    marker = os.path.join(site, ".kit-sha256")
    return os.path.isfile(marker) and open(marker).read() == manifest["archive_sha256"]


def _matches(path: str, piece: dict) -> bool:
    return os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) == piece["bytes"] \
        and sha256(path) == piece["sha256"]


def dropped_import(log: str, manifest: dict) -> str:
    """The dropped file a failed run imported after all, from its log ("No module named 'vllm._qutlass_C'"), or ''."""
    for module in re.findall(r"No module named '([\w.]+)'", log):
        path = module.replace(".", "/")
        for pattern, why in manifest.get("dropped_patterns", DROPPED):
            if fnmatch.fnmatch(path + ".abi3.so", pattern) or fnmatch.fnmatch(path + "/__init__.py", pattern) \
                    or fnmatch.fnmatch(path + ".py", pattern):
                return f"vLLM imported {module}, which the kit leaves out ({pattern}: {why}): keep it in " \
                       "benchmarks/gpu_kit.py DROPPED's place and run `make gpu-e2e-kit` again"
        return f"{module} is missing on the GPU machine and not in the kit: add it to benchmarks/gpu_kit.py ONE_GPU " \
               "and run `make gpu-e2e-kit` again"
    return ""


# prepare: here, with a network.

def _platform(python_version: str) -> list:
    # The GPU machines' glibc (Ubuntu 24.04's Python 3.12.3: 2.39) takes wheels of any manylinux tag up to it.
    tags = [arg for minor in range(17, 40) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")]
    return ["--python-version", python_version, "--implementation", "cp", *tags, "--platform",
            "manylinux2014_x86_64", "--only-binary", ":all:"]


def _requirements(wheel: str, python_version: str) -> list:
    """A wheel's requirements without extras, under the GPU machine's Python on Linux x86_64."""
    import zipfile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    env = {"python_version": python_version, "python_full_version": python_version + ".3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": "", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append((canonicalize_name(req.name), req))
    return out


def _project(wheel_name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(wheel_name.split("-")[0])


def download(wheels: str, python_version: str) -> list:
    """vLLM, ONE_GPU, DeepSpeed, and every requirement of theirs that neither the image, the kit nor NOT_NEEDED
    covers (pinned to the version installed here where there is one); returns the kit's projects."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.utils import canonicalize_name

    os.makedirs(wheels, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels,
                    f"{DEEPSPEED}=={version(DEEPSPEED)}"], check=True)
    todo = [VLLM, *ONE_GPU]
    while todo:
        subprocess.run([*pip, "download", "-q", "--no-deps", "-d", wheels, *_platform(python_version), *todo],
                       check=True)
        have = {_project(n) for n in os.listdir(wheels)}
        todo = []
        for name in sorted(os.listdir(wheels)):
            for project, req in _requirements(os.path.join(wheels, name), python_version):
                if project in have or project in IMAGE or project in NOT_NEEDED or \
                        any(canonicalize_name(t.split("=")[0]) == project for t in todo):
                    continue
                try:
                    todo.append(f"{project}=={version(project)}")
                except PackageNotFoundError:
                    todo.append(str(req).split(";")[0])
    return sorted({_project(n) for n in os.listdir(wheels)})


def prune(site: str) -> list:
    """Remove DROPPED from the installed folder: [(path, MiB, why)]."""
    dropped = []
    for folder, dirs, files in os.walk(site, topdown=True):
        for name in list(dirs) + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, site)
            for pattern, why in DROPPED:
                if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(rel + "/*", pattern):
                    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) \
                        if os.path.isdir(path) else os.path.getsize(path)
                    dropped.append((rel, round(size / 2**20, 2), why))
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                    if name in dirs:
                        dirs.remove(name)
                    break
    return dropped


def prepare(folder: str, python_version: str) -> dict:
    """Download, install for the GPU machine's Python, prune and pack (see the module's doc)."""
    wheels, site = os.path.join(folder, "wheels"), os.path.join(folder, "site")
    shutil.rmtree(site, ignore_errors=True)
    projects = download(wheels, python_version)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index",
                    "--target", site, *_platform(python_version),
                    *sorted(os.path.join(wheels, w) for w in os.listdir(wheels))], check=True)
    dropped = prune(site)
    manifest = pack(site, folder, extra={"python_version": python_version, "packages": projects,
                                         "dropped": dropped, "dropped_patterns": DROPPED, "image": sorted(IMAGE)})
    shutil.rmtree(site)
    shutil.rmtree(wheels)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download, install, prune and pack the kit (needs a network)")
    p.add_argument("folder")
    p.add_argument("--python_version", default="3.12", help="the GPU machine's Python")
    m = sub.add_parser("measure", help="the calls an existing kit takes, as one JSON line")
    m.add_argument("folder")
    s = sub.add_parser("stage", help="gather the pieces found here into DEST; unpack once complete")
    s.add_argument("folder")
    s.add_argument("dest")
    args = ap.parse_args(argv)
    if args.command == "stage":
        return stage(args.folder, args.dest)
    manifest = prepare(args.folder, args.python_version) if args.command == "prepare" else read_manifest(args.folder)
    report = calls_of(manifest, travelling_bytes())
    report["before_mib"] = 363  # the kit of 090a44e: 65 wheels in 7 pieces of 56 MiB
    report["dropped"] = [f"{path} ({mib} MiB)" for path, mib, _ in manifest.get("dropped", [])]
    report["packages"] = len(manifest.get("packages", []))
    print(json.dumps(report), flush=True)
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
