"""User-facing errors: one line that names the problem, printed by the CLI without a traceback."""


class StrataError(Exception):
    """A problem with the user's input or environment (bad file, impossible budget, bad token ids...)."""


class ModelFormatError(StrataError):
    """The file is not a usable GGUF: missing, truncated, not GGUF, unknown architecture/tensor/quant."""


class PackError(StrataError):
    """An expert pack is missing, corrupt, or does not match its GGUF."""
