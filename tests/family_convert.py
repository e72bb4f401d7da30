"""Run llama.cpp's convert_hf_to_gguf.py with its tokenizer step replaced by given GGUF tokenizer metadata.

    python tests/family_convert.py CONVERTER_DIR VOCAB_JSON -- CONVERTER_ARGS...

CONVERTER_DIR holds convert_hf_to_gguf.py, conversion/ and gguf-py/ (tests/family.py converter_dir()); VOCAB_JSON
is a list of [key, kind, value] triples as strata_nb.synth.vocab.tokenizer_metadata returns them. The model
directory (first converter argument) needs no tokenizer files. Run by tests/family.py in a subprocess: the
converter's gguf-py must be imported instead of the installed gguf package.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _write_tokenizer(writer, meta: list[list]) -> None:
    from gguf import GGUFValueType as V

    for key, kind, value in meta:
        if kind == "str":
            writer.add_string(key, value)
        elif kind == "u32":
            writer.add_uint32(key, int(value))
        elif kind == "i32":
            writer.add_int32(key, int(value))
        elif kind == "f32":
            writer.add_float32(key, float(value))
        elif kind == "bool":
            writer.add_bool(key, bool(value))
        elif kind == "[str]":
            writer.add_key_value(key, list(value), V.ARRAY, sub_type=V.STRING)
        elif kind == "[i32]":
            writer.add_key_value(key, [int(x) for x in value], V.ARRAY, sub_type=V.INT32)
        else:
            raise ValueError(f"unsupported metadata kind {kind!r} for {key}")


def main() -> None:
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        raise SystemExit(__doc__)
    converter, vocab_json, args = Path(sys.argv[1]).resolve(), Path(sys.argv[2]), sys.argv[4:]
    sys.path[:0] = [str(converter / "gguf-py"), str(converter)]
    import gguf

    if not Path(gguf.__file__).resolve().is_relative_to(converter):
        raise SystemExit(f"imported gguf from {gguf.__file__}, not from the converter's gguf-py in {converter}")
    import convert_hf_to_gguf  # noqa: F401  (main() below; importing runs nothing else)
    from conversion import get_model_class

    meta = json.loads(vocab_json.read_text())
    hparams = json.loads((Path(args[0]) / "config.json").read_text())
    model_class = get_model_class(hparams["architectures"][0])

    def set_vocab(self) -> None:
        _write_tokenizer(self.gguf_writer, meta)

    model_class.set_vocab = set_vocab
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), *args]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
