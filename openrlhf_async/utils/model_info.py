"""What the config's checks learn about a model path without loading or converting the model: whether it is a GGUF
file, a GGUF file's context length (from its metadata), the embedded tiny model's positions. Building the tiny model
and converting a GGUF file are models/'s (tiny.py, gguf.py), which read these too."""

TINY_MAX_POSITIONS = 256  # the embedded tiny model's max_position_embeddings (models/tiny.py builds it)


def is_gguf(path: str) -> bool:
    return bool(path) and path.lower().endswith(".gguf")


def gguf_context_length(path: str) -> int:
    """The model's context length, from the file's metadata ("<architecture>.context_length")."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = bytes(gguf_value(fields["general.architecture"])).decode()
    return int(gguf_value(fields[f"{arch}.context_length"])[0])


def gguf_value(field):
    """A GGUF metadata field's value (as the reader's array: one number, or a string's bytes)."""
    return field.parts[field.data[0]]
