"""The wheels `make gpu-e2e` needs on a GPU machine that has torch and transformers but no vLLM, no DeepSpeed and no
network, in pieces that travel one command each (at most 64 MiB goes with a command there, and what a command writes
outside the repository stays only while the machine is warm: the pieces go to a folder of their own, back to back).

    prepare FOLDER   (here, with a network) the wheels: vLLM's CUDA build at the release the GPU machine's torch
                     runs (VLLM), what it imports for one engine at tensor parallel 1 without Ray (ONE_GPU), and
                     DeepSpeed's and accelerate's (benchmarks/gpu_check.py); packed into one archive, cut into
                     pieces of PIECE_BYTES, each named in FOLDER/manifest.json with its SHA-256.
    stage FOLDER DEST  (there, one command per piece) copy the pieces found in FOLDER to DEST, each checked against
                     the manifest; once DEST holds all of them, join them, check the whole archive's digest and
                     unpack the wheels into DEST/wheels. Prints what is there and what is still missing.

Exit status of stage: 0 when the wheels are ready, 3 while pieces are missing, 1 on a digest that does not match."""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VLLM = "vllm==0.26.0"  # the release built for torch 2.11 and CUDA 13, what the GPU machines run
# What vLLM 0.26 imports to run one AsyncLLM engine (its engine core in a process of its own, one GPU, no Ray) beyond
# torch, transformers (and what they need), triton and peft, which the GPU machines have: found by importing its
# engine, worker, model runner, Qwen2 model, weight transfer and sleep allocator with each package removed in turn
# (2026-11-27, a Python 3.11 venv with PyPI's torch 2.11.0 and the platform forced to CUDA; the cp312 wheels
# install with --no-deps). openai 2.x: 3.x would need httpx2 and httpcore2; xgrammar 0.2.7 with tvm-ffi 0.1.10, as
# vLLM's pin resolves. Not among them: flashinfer (gpu_e2e.py turns its sampler off), blake3 (images only), Ray.
ONE_GPU = ("aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "apache-tvm-ffi==0.1.10",
           "attrs==26.1.0", "cachetools==8.0.2", "cbor2==6.3.0", "cloudpickle==3.1.3", "distro==1.9.0",
           "einops==0.8.2", "fastapi==0.136.3", "frozenlist==1.8.0", "llguidance==1.7.6", "msgspec==0.22.0",
           "multidict==7.2.1", "openai==2.54.0", "openai-harmony==0.0.8", "pillow==13.0.0",
           "prometheus_client==0.26.0", "propcache==0.5.4", "py-cpuinfo==9.0.0", "pybase64==1.5.1",
           "pyzmq==27.3.0", "requests==2.34.2", "sniffio==1.3.1", "starlette==1.10.0", "urllib3==2.8.0",
           "uvloop==0.23.0", "xgrammar==0.2.7", "yarl==1.25.1")
PIECE_BYTES = 56 << 20  # a piece and the manifest travel under the 64 MiB a command carries
ARCHIVE = "wheels.tar"


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cut(archive: str, folder: str, piece_bytes: int = PIECE_BYTES) -> list:
    """The archive in pieces of piece_bytes (the last shorter): [(name, size, sha256)]."""
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


def pack(wheels: str, folder: str, piece_bytes: int = PIECE_BYTES) -> dict:
    """The wheels of `wheels` as one uncompressed archive (wheels are compressed already), cut into pieces in
    folder, with the manifest written there; returns the manifest."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.startswith("piece-") or name == "manifest.json":
            os.remove(os.path.join(folder, name))
    names = sorted(n for n in os.listdir(wheels) if n.endswith(".whl"))
    archive = os.path.join(folder, ARCHIVE)
    with tarfile.open(archive, "w") as tar:
        for name in names:
            tar.add(os.path.join(wheels, name), arcname=name)
    manifest = {"wheels": names, "archive_bytes": os.path.getsize(archive), "archive_sha256": sha256(archive),
                "pieces": cut(archive, folder, piece_bytes)}
    os.remove(archive)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def stage(folder: str, dest: str) -> int:
    """Copy the pieces in folder to dest, checked; join and unpack once all are there (see the module's doc)."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    os.makedirs(dest, exist_ok=True)
    for piece in manifest["pieces"]:
        source, target = os.path.join(folder, piece["name"]), os.path.join(dest, piece["name"])
        if os.path.isfile(source) and not _matches(target, piece):
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
    wheels = os.path.join(dest, "wheels")
    if all(os.path.isfile(os.path.join(wheels, w)) for w in manifest["wheels"]):
        print(f"gpu-kit: the wheels are ready in {wheels}", flush=True)
        return 0
    archive = os.path.join(dest, ARCHIVE)
    with open(archive, "wb") as out:
        for piece in manifest["pieces"]:
            with open(os.path.join(dest, piece["name"]), "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(archive) != manifest["archive_sha256"]:
        os.remove(archive)
        print("gpu-kit: the joined pieces do not match the archive's digest: run `make gpu-e2e-kit` again", flush=True)
        return 1
    with tarfile.open(archive) as tar:
        tar.extractall(wheels, filter="data")
    os.remove(archive)
    for piece in manifest["pieces"]:  # the disk is the machine's: the wheels alone stay
        os.remove(os.path.join(dest, piece["name"]))
    print(f"gpu-kit: the wheels are ready in {wheels} ({len(manifest['wheels'])} wheels)", flush=True)
    return 0


def _matches(path: str, piece: dict) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == piece["bytes"] and sha256(path) == piece["sha256"]


def prepare(folder: str, python_version: str) -> dict:
    """Download the wheels (pip, from the package index) and pack them into folder."""
    from benchmarks.gpu_check import download_wheels

    wheels = os.path.join(folder, "wheels")
    os.makedirs(wheels, exist_ok=True)
    download_wheels(wheels, python_version)  # deepspeed, accelerate and theirs, less what torch brings
    # The GPU machines' glibc (Ubuntu 24.04's Python 3.12.3: 2.39) takes wheels of any manylinux tag up to it.
    platform = [arg for minor in range(17, 40) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")]
    platform += ["--platform", "manylinux2014_x86_64", "--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, VLLM, *ONE_GPU]
    if python_version:
        cmd[5:5] = ["--python-version", python_version, *platform]
    subprocess.run(cmd, check=True)
    manifest = pack(wheels, folder)
    shutil.rmtree(wheels)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download and cut the wheels into pieces (needs a network)")
    p.add_argument("folder")
    p.add_argument("--python_version", default="3.12", help="the GPU machine's Python")
    s = sub.add_parser("stage", help="gather the pieces found here into DEST; unpack once complete")
    s.add_argument("folder")
    s.add_argument("dest")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        manifest = prepare(args.folder, args.python_version)
        total = sum(p["bytes"] for p in manifest["pieces"])
        print(f"gpu-kit: {len(manifest['wheels'])} wheels, {total / 2**20:.0f} MiB in {len(manifest['pieces'])} "
              f"pieces in {args.folder}", flush=True)
        return 0
    return stage(args.folder, args.dest)


if __name__ == "__main__":
    sys.exit(main())
