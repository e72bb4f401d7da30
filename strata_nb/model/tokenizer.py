"""Text <-> token ids from a GGUF's own tokenizer metadata (tokenizer.ggml.*), matching llama.cpp.

The merge loops run in the `tokenizers` library; everything llama.cpp does around them is reproduced here:
special-token partitioning (src/llama-vocab.cpp tokenizer_st_partition), BOS/EOS rules, the SentencePiece
dummy prefix, the end-of-generation set (llama_vocab::is_eog), token_to_piece and llama_detokenize including
its clean-up of spaces. Vocab types: `gpt2` (byte-level BPE with the file's pre-tokenizer) and `llama`
(SentencePiece-style BPE by score with <0xXX> byte fallback).
"""
from __future__ import annotations

import codecs
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from strata_nb.errors import ModelFormatError, StrataError
from strata_nb.model.gguf_file import GGUFFile

# llama_token_attr bits (llama.h) and the GGUF token types they come from (llama_token_type).
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
_ATTR_OF_TYPE = np.array([ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED,
                          ATTR_BYTE], dtype=np.int64)  # indexed by GGUF token type
_ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL  # hidden by token_to_piece unless special=True

SUPPORTED_VOCAB_TYPES = ("gpt2", "llama")

# Pre-tokenizer regexes, copied from llama.cpp's llm_tokenizer_bpe (they are applied in sequence, each
# splitting the pieces of the previous one, matches and gaps alike: tokenizers' Split "isolated").
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreType:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not merged (llama3)
    clean_spaces: bool = True  # llama_detokenize's " ," -> "," clean-up
    add_bos: bool = False  # the vocab's default before tokenizer.ggml.add_bos_token


_LLAMA3 = _PreType((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = _PreType((_RE_GPT2,))
_QWEN2 = _PreType((_RE_QWEN2,), clean_spaces=False)
_GPT4O = _PreType((_RE_GPT4O,))
# tokenizer.ggml.pre -> llama.cpp's settings for it (llama_vocab::impl::load).
_PRE_TYPES: dict[str, _PreType] = {
    "default": _PreType(_RE_DEFAULT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    "dbrx": _PreType((_RE_LLAMA3,)),
    "smaug-bpe": _PreType((_RE_LLAMA3,)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), _GPT2),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "hunyuan"), _QWEN2),
    "stablelm2": _PreType((_RE_QWEN2,)),
    "qwen35": _PreType((_RE_QWEN35,), clean_spaces=False),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), _GPT4O),
    "minimax-m2": _PreType((_RE_GPT4O,), clean_spaces=False),
}

# Token texts llama.cpp treats as end of generation (llama_vocab::impl::load, special_eog_ids).
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# Token texts llama.cpp auto-detects as EOT/EOM/FIM tokens when the file names none (each gets CONTROL).
_AUTO_SPECIAL: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Metadata keys for those ids (the deprecated prefix/suffix/middle keys override, as in llama.cpp).
_SPECIAL_KEYS: dict[str, tuple[str, ...]] = {
    "eot": ("eot_token_id",), "eom": ("eom_token_id",),
    "fim_pre": ("fim_pre_token_id", "prefix_token_id"), "fim_suf": ("fim_suf_token_id", "suffix_token_id"),
    "fim_mid": ("fim_mid_token_id", "middle_token_id"), "fim_pad": ("fim_pad_token_id",),
    "fim_rep": ("fim_rep_token_id",), "fim_sep": ("fim_sep_token_id",),
}

_SPM_SPACE = "\u2581"  # ▁


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = _byte_level_alphabet()
_UNMAP_TABLE = {ord(c): b for c, b in _BYTE_OF_CHAR.items()}  # str.translate: alphabet char -> latin-1 char


def _unmap_byte_level(text: str) -> bytes:
    """llama.cpp's llama_decode_text: byte-level token text -> the bytes it stands for."""
    try:
        return text.translate(_UNMAP_TABLE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: llama.cpp writes a marker for it
        out = bytearray()
        for ch in text:
            b = _BYTE_OF_CHAR.get(ch)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)


def _spm_merges(tokens: Sequence[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """Merges that make BPE reproduce llama.cpp's SPM tokenizer: any two adjacent pieces whose concatenation
    is a token merge, the best-scored concatenation first (llm_tokenizer_spm_session's bigram queue)."""
    vocab = set(tokens)
    cands: list[tuple[float, int, str, str]] = []
    for tid, tok in enumerate(tokens):
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                cands.append((-float(scores[tid]), tid, left, right))
    cands.sort()
    return [(a, b) for _, _, a, b in cands]


class Tokenizer:
    """A GGUF file's tokenizer, behaving like llama.cpp's llama_tokenize / llama_token_to_piece / llama_detokenize."""

    def __init__(self, meta: dict[str, Any], source: str = "GGUF") -> None:
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError(f"{source} has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in SUPPORTED_VOCAB_TYPES:
            raise ModelFormatError(f"{source}: tokenizer type {model!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_VOCAB_TYPES)})")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError(f"{source} has no tokenizer.ggml.tokens")
        n = len(tokens)
        # llama.cpp renames empty tokens so that every text maps back to one id
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.vocab_type: str = model
        self.pre: str = str(meta.get("tokenizer.ggml.pre", "default") or "default")
        self._tokens: list[str] = tokens
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(tokens)}  # last id wins, as in llama.cpp

        types = meta.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise ModelFormatError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        if types is None:
            attrs = [ATTR_NORMAL] * n
        else:
            types = np.asarray(types[:n], dtype=np.int64)
            types[(types < 0) | (types >= len(_ATTR_OF_TYPE))] = 0  # unknown types read as UNDEFINED
            attrs = _ATTR_OF_TYPE[types].tolist()
        self._attrs = attrs

        spm = model == "llama"
        if spm:
            pre = _PreType((), clean_spaces=False, add_bos=True)
            bos, eos, unk = 1, 2, 0
            add_space_prefix = True
        else:
            if self.pre not in _PRE_TYPES:
                raise ModelFormatError(f"{source}: pre-tokenizer {self.pre!r} is not supported "
                                       f"(supported: {', '.join(sorted(_PRE_TYPES))})")
            pre = _PRE_TYPES[self.pre]
            bos, eos, unk = 11, 11, -1
            add_space_prefix = False
        self.add_space_prefix: bool = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        self.clean_spaces: bool = pre.clean_spaces

        def special_id(key: str, default: int) -> int:
            default = default if 0 <= default < n else -1
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < n else default

        self.bos_id: int = special_id("bos_token_id", bos)
        self.eos_id: int = special_id("eos_token_id", eos)
        self.unk_id: int = special_id("unknown_token_id", unk)
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos))
        self.add_eos: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id < 0:
            raise ModelFormatError(f"{source}: tokenizer adds a BOS token but has no valid bos_token_id")
        if self.add_eos and self.eos_id < 0:
            raise ModelFormatError(f"{source}: tokenizer adds an EOS token but has no valid eos_token_id")

        specials = self._find_special_ids(meta, n)
        self.eot_id: int = specials["eot"]
        self.eog_ids: frozenset[int] = self._eog_set(specials)
        self.chat_template: str | None = meta.get("tokenizer.chat_template")

        # Tokens matched whole in the text before the merges run, longest first (llama.cpp's special cache).
        special_ids = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special_ids.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self._special_ids = special_ids

        self._pieces: list[bytes | None] = [None] * n  # token_to_piece(special=True), filled on first use
        self._hf = self._build_hf(meta, pre, source)

    # -- construction helpers ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, src: "GGUFFile | str | os.PathLike[str]") -> "Tokenizer":
        """From an open GGUFFile or the path of a GGUF file (its tokenizer.* metadata)."""
        g = src if isinstance(src, GGUFFile) else GGUFFile(src)
        meta = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
        return cls(meta, g.path.name)

    def _find_special_ids(self, meta: dict[str, Any], n: int) -> dict[str, int]:
        ids: dict[str, int] = {}
        for kind, keys in _SPECIAL_KEYS.items():
            tid = -1
            for key in keys:
                v = meta.get(f"tokenizer.ggml.{key}")
                if v is not None and 0 <= int(v) < n:
                    tid = int(v)
            if tid < 0:
                # llama.cpp takes whichever candidate its hash map yields first; we take the first listed
                for text in _AUTO_SPECIAL[kind]:
                    if text in self._token_to_id:
                        tid = self._token_to_id[text]
                        self._attrs[tid] |= ATTR_CONTROL
                        break
            ids[kind] = tid
        return ids

    def _eog_set(self, specials: dict[str, int]) -> frozenset[int]:
        attrs = self._attrs
        eog = {specials[k] for k in ("fim_pad", "fim_rep", "fim_sep") if specials[k] >= 0}
        for text in _EOG_TEXTS:
            tid = self._token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= ATTR_CONTROL
        # gpt-oss: these are always rendered (llama.cpp forces them to USER_DEFINED)
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if text in self._token_to_id:
                attrs[self._token_to_id[text]] = ATTR_USER_DEFINED
        eog.update(i for i in (self.eos_id, specials["eot"], specials["eom"]) if i >= 0)
        texts = {self._tokens[i]: i for i in eog}
        # o200k_harmony / solar-open: <|end|> ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 / plamo: </s> is an ordinary token there
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = ATTR_NORMAL
        return frozenset(eog)

    def _make_piece(self, tid: int) -> bytes:
        """llama_token_to_piece(special=True): the bytes a token stands for."""
        attr, text = self._attrs[tid], self._tokens[tid]
        if attr & (_ATTR_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.vocab_type == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8")
            return _unmap_byte_level(text)
        if attr & ATTR_BYTE:  # <0xXX>; llama.cpp's strtol reads a malformed one as 0
            try:
                return bytes((int(text[3:5], 16),))
            except ValueError:
                return b"\x00"
        return b""  # unused / undefined tokens print nothing

    def _build_hf(self, meta: dict[str, Any], pre: _PreType, source: str) -> _HFTokenizer:
        vocab = self._token_to_id
        try:
            if self.vocab_type == "llama":
                scores = meta.get("tokenizer.ggml.scores")
                if scores is None or len(scores) < len(self._tokens):
                    raise ModelFormatError(f"{source}: SentencePiece vocabulary without tokenizer.ggml.scores")
                unk = self._tokens[self.unk_id] if self.unk_id >= 0 else None
                bpe = models.BPE(vocab, _spm_merges(self._tokens, np.asarray(scores)), unk_token=unk,
                                 byte_fallback=True)
                return _HFTokenizer(bpe)
            raw_merges = meta.get("tokenizer.ggml.merges")
            if raw_merges is None:
                raise ModelFormatError(f"{source}: BPE vocabulary without tokenizer.ggml.merges")
            merges = []
            for m in raw_merges:
                i = m.find(" ", 1)  # as llama.cpp: the first space after the first character
                if i > 0:
                    merges.append((m[:i], m[i + 1:]))
            hf = _HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
        except ModelFormatError:
            raise
        except Exception as e:  # tokenizers raises plain Exceptions for merges that name unknown tokens
            raise ModelFormatError(f"{source}: inconsistent tokenizer vocabulary/merges: {e}") from None
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    # -- queries ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def is_eog(self, tid: int) -> bool:
        """True for every token that ends generation (llama_vocab_is_eog)."""
        return tid in self.eog_ids

    def token_text(self, tid: int) -> str:
        """The token as the vocabulary spells it (byte-level or ▁ form)."""
        self._check_id(tid)
        return self._tokens[tid]

    def token_to_id(self, text: str) -> int | None:
        """The id of a token spelled as the vocabulary spells it, or None."""
        return self._token_to_id.get(text)

    def token_bytes(self, tid: int) -> bytes:
        """The raw bytes a token stands for (control tokens: their text)."""
        self._check_id(tid)
        return self._piece(tid)

    def piece(self, tid: int, special: bool = False) -> bytes:
        """llama_token_to_piece(lstrip=0): as token_bytes, but control/unknown tokens are empty unless special."""
        self._check_id(tid)
        if not special and self._attrs[tid] & _ATTR_SPECIAL:
            return b""
        return self._piece(tid)

    def _piece(self, tid: int) -> bytes:
        p = self._pieces[tid]
        if p is None:
            p = self._pieces[tid] = self._make_piece(tid)
        return p

    def _check_id(self, tid: int) -> None:
        if not 0 <= tid < len(self._tokens):
            raise StrataError(f"token id {tid} is out of range for a vocabulary of {len(self._tokens)} tokens")

    # -- text -> ids --------------------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split out special tokens, longest first, each across all remaining text (tokenizer_st_partition)."""
        frags: list[str | int] = [text]
        for tid in self._special_ids:
            if not parse_special and self._attrs[tid] & _ATTR_SPECIAL:
                continue  # user-defined tokens are matched even then
            tok = self._tokens[tid]
            if not any(isinstance(f, str) and tok in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if not isinstance(f, str) or tok not in f:
                    out.append(f)
                    continue
                parts = f.split(tok)
                for j, p in enumerate(parts):
                    if j:
                        out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize: BOS/EOS as the vocabulary says when add_special; special tokens in the text are
        single ids when parse_special (user-defined tokens always are)."""
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if self.vocab_type == "llama":
            # SentencePiece dummy prefix: a space before the text and after every special token
            raw, prev_special = [], True
            for f in frags:
                if isinstance(f, str):
                    raw.append(((" " if self.add_space_prefix and prev_special else "") + f).replace(" ", _SPM_SPACE))
                    prev_special = False
                else:
                    raw.append(f)
                    prev_special = True
            frags = raw
        texts = [f for f in frags if isinstance(f, str)]
        encoded = iter(self._hf.encode_batch(texts, add_special_tokens=False) if texts else ())
        for f in frags:
            if isinstance(f, str):
                out.extend(next(encoded).ids)
            else:
                out.append(f)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # -- ids -> text --------------------------------------------------------------------------------------
    def detokenize(self, ids: Iterable[int], special: bool = False) -> bytes:
        """llama_detokenize(remove_special=False, unparse_special=special), as bytes."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= len(self._tokens)):
            bad = next(i for i in ids if not 0 <= i < len(self._tokens))
            self._check_id(bad)
        attrs, piece = self._attrs, self._piece
        parts = [b"" if not special and attrs[i] & _ATTR_SPECIAL else piece(i) for i in ids]
        if parts and self.add_space_prefix and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]  # only the first token loses its leading space (the dummy prefix)
        raw = b"".join(parts)
        return clean_spaces(raw) if self.clean_spaces else raw

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Token ids -> text as llama_detokenize gives it; control tokens shown only when special.
        Bytes that are not valid UTF-8 become U+FFFD."""
        return self.detokenize(ids, special).decode("utf-8", errors="replace")


_CLEAN_1 = re.compile(rb" (?=[?!.,])")
_CLEAN_2 = re.compile(rb" ' ")
_CLEAN_3 = re.compile(rb" (?='(?:[sm]|re|ve))")
# each pass, and which bytes of one of its matches it removes (all of them spaces)
_CLEAN_PASSES = ((_CLEAN_1, (0,)), (_CLEAN_2, (0, 2)), (_CLEAN_3, (0,)))


def clean_spaces(raw: bytes) -> bytes:
    """llama_detokenize's clean_spaces passes: " ?" " !" " ." " ," lose the space, " ' " becomes "'", and
    " 's" " 'm" " 're" " 've" lose the space, each pass over the output of the one before."""
    return _CLEAN_3.sub(b"", _CLEAN_2.sub(b"'", _CLEAN_1.sub(b"", raw)))


def _removed_by_clean(raw: bytes) -> set[int]:
    """Positions in `raw` of the spaces clean_spaces removes."""
    removed: set[int] = set()
    where: Sequence[int] = range(len(raw))  # position in raw of each byte of the current pass's input
    text = raw
    for pattern, offsets in _CLEAN_PASSES:
        gone = {m.start() + k for m in pattern.finditer(text) for k in offsets}
        if gone:
            removed.update(where[j] for j in gone)
            kept = [j for j in range(len(text)) if j not in gone]
            where = [where[j] for j in kept]
            text = bytes(text[j] for j in kept)
    return removed


def _space_settled(raw: bytearray, s: int) -> bool:
    """Whether clean_spaces' verdict on the space at raw[s] is fixed whatever bytes follow raw.

    The verdict reads at most 5 bytes ahead (" ' 're" loses its first space once " ' " becomes "'"), and
    fewer unless an apostrophe or another space follows."""
    n = len(raw)
    if s + 1 >= n:
        return False
    nxt = raw[s + 1]
    if nxt == 0x27:  # ' : " 's", " 're", " ' " need up to 3 bytes after the space
        return s + 3 < n
    if nxt == 0x20:  # "  ' s" / "  ' re": the second space may vanish and expose an apostrophe
        return s + 2 < n and (raw[s + 2] != 0x27 or s + 5 < n)
    return True


class StreamDecoder:
    """Turns generated token ids into text as they arrive, never splitting a UTF-8 character.

    The concatenated output of push() and flush() equals Tokenizer.decode() of all ids pushed. Bytes of an
    incomplete character are held back until it completes; with clean_spaces vocabularies a space is held
    back until the bytes after it show whether llama_detokenize drops it. By default the first token loses
    one leading space when the vocabulary adds a dummy prefix (SentencePiece), as llama_detokenize does;
    lstrip_first=False keeps llama_token_to_piece's pieces unchanged (a continuation of a prompt)."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False, lstrip_first: bool | None = None) -> None:
        self._tok = tokenizer
        self._special = special
        self._lstrip = tokenizer.add_space_prefix if lstrip_first is None else lstrip_first
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # clean_spaces state: raw bytes since the last point where the clean-up restarts independently,
        # and how many of them were already handed on
        self._pending = bytearray()
        self._done = 0

    def push(self, tid: int) -> str:
        piece = self._tok.piece(tid, self._special)
        if self._lstrip:
            if piece[:1] == b" ":
                piece = piece[1:]
            self._lstrip = False
        if not self._tok.clean_spaces:
            return self._utf8.decode(piece)
        pend = self._pending
        pend += piece
        # hand on everything before the first space whose fate is still open (only the last 6 bytes can be)
        ready = len(pend)
        for s in range(max(self._done, len(pend) - 6), len(pend)):
            if pend[s] == 0x20 and not _space_settled(pend, s):
                ready = s
                break
        if ready <= self._done:
            return ""
        removed = _removed_by_clean(bytes(pend))
        out = bytes(pend[i] for i in range(self._done, ready) if i not in removed) if removed else \
            bytes(pend[self._done:ready])
        self._done = ready
        if b" " not in pend[max(0, ready - 3):ready]:
            # no clean-up pattern spans this point (each ends at most 3 bytes after its last space), so the
            # text after it cleans the same on its own
            del pend[:ready]
            self._done = 0
        return self._utf8.decode(out)

    def flush(self) -> str:
        """The text still held back (an incomplete character becomes U+FFFD); the decoder starts afresh."""
        rest = b""
        if self._pending:
            removed = _removed_by_clean(bytes(self._pending))
            rest = bytes(b for i, b in enumerate(self._pending) if i >= self._done and i not in removed)
        self._pending.clear()
        self._done = 0
        self._lstrip = False
        return self._utf8.decode(rest, final=True)
