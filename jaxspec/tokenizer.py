"""Tokenizers for jaxspec: built from a GGUF file's vocabulary, or loaded from a Hugging Face folder.

A GGUF file carries no ``tokenizer.json``. It stores the vocabulary, the BPE merges, a type per token and the ids
of the special tokens as metadata under llama.cpp's key names (``tokenizer.ggml.*``), plus the chat template. This
module rebuilds a ``tokenizers.Tokenizer`` from that metadata with the ``tokenizers`` library directly and wraps it
in a ``transformers.PreTrainedTokenizerFast``, so ``encode``, ``decode`` and ``apply_chat_template`` work as with
any Hugging Face tokenizer.

Supported are byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with one of the pre-tokenizers in
:data:`SUPPORTED_PRE_TOKENIZERS` (``tokenizer.ggml.pre``): SmolLM2 (``"smollm"``), Qwen2/2.5 (``"qwen2"``),
Llama 3 (``"llama-bpe"``) and a few others that share their splitting rules; and Gemma's SentencePiece vocabularies
(``"llama"`` in a gemma/gemma2/gemma3 file). Each one is rebuilt the way the
model's original ``tokenizer.json`` splits text; that is also how llama.cpp splits it, except that llama.cpp
skips the NFC normalization of Qwen2's ``tokenizer.json``.

Example:
    >>> from jaxspec.tokenizer import load_tokenizer
    >>> tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    >>> tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from jaxspec.gguf_file import GGUFFile

__all__ = ["SUPPORTED_PRE_TOKENIZERS", "load_tokenizer", "tokenizer_from_gguf"]

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType), as stored in tokenizer.ggml.token_type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# GPT-2's split ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) needs no regex here:
# `pre_tokenizers.ByteLevel(use_regex=True)` applies exactly that one.
# Llama 3's split (tokenizer.json of Meta-Llama-3; llama.cpp's LLAMA3 pre-tokenizer).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen2's split: as Llama 3's, but numbers are cut into single digits.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerSpec:
    """How one family of byte-level BPE vocabularies splits and normalizes text.

    Attributes:
        split: Regex applied by a ``Split`` pre-tokenizer before the byte-level mapping; ``None`` means the GPT-2
            split built into ``ByteLevel(use_regex=True)``.
        digits: Isolate every digit before splitting (``Digits(individual_digits=True)``), as StarCoder and
            SmolLM do.
        nfc: Apply Unicode NFC normalization first (Qwen2's ``tokenizer.json`` does).
        ignore_merges: A word that is a whole vocabulary entry is taken as is, without merging (Llama 3).
        add_bos: Whether to prepend BOS when the file has no ``tokenizer.ggml.add_bos_token`` key.
    """

    split: str | None = None
    digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = _PreTokenizerSpec()
_DIGITS_GPT2 = _PreTokenizerSpec(digits=True)
_LLAMA3 = _PreTokenizerSpec(split=_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_LLAMA3_LIKE = _PreTokenizerSpec(split=_LLAMA3_SPLIT)
_QWEN2 = _PreTokenizerSpec(split=_QWEN2_SPLIT, nfc=True)

#: ``tokenizer.ggml.pre`` values this module can rebuild, and how.
SUPPORTED_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3_LIKE,
    "dbrx": _LLAMA3_LIKE,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _PreTokenizerSpec(split=_QWEN2_SPLIT),
}

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character.

    Returns:
        A dict from byte value (0..255) to the one-character string that spells it in byte-level vocabularies.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_vocab(tokens: list[str], token_types: list[int], keep: set[int]) -> dict[str, int]:
    """Map each token to its id, spelling normal tokens in the byte-level alphabet.

    Byte-level GGUF vocabularies already store their tokens spelled with GPT-2's byte alphabet (``"Ġthe"``). A
    normal token that uses any other character is respelled from its UTF-8 bytes, so BPE can reach it. Control and
    user-defined tokens, and the ids in ``keep``, stay as written: they are matched whole in the raw text as added
    tokens.

    Args:
        tokens: ``tokenizer.ggml.tokens``.
        token_types: ``tokenizer.ggml.token_type`` (same length), or all-normal if the file has none.
        keep: Ids whose token is kept as written whatever its type (the BOS/EOS/UNK/PAD tokens).

    Returns:
        The vocabulary, token string to id. When a string occurs twice, the first id keeps it.
    """
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    duplicates = 0
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type not in (_CONTROL, _USER_DEFINED) and index not in keep and not set(token) <= alphabet:
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        if token in vocab:
            duplicates += 1
            continue
        vocab[token] = index
    if duplicates:
        logger.warning("GGUF vocabulary has %d duplicate token strings; the first id of each is used.", duplicates)
    return vocab


def _parse_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Turn ``"left right"`` merge strings into pairs.

    Args:
        merges: ``tokenizer.ggml.merges``.
        vocab: The vocabulary, used to place the cut when a merge holds more than one space.

    Returns:
        The merges as ``(left, right)`` pairs, in priority order.

    Raises:
        ValueError: If a merge cannot be cut into two vocabulary tokens.
    """
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) == 2:
            pairs.append((parts[0], parts[1]))
            continue
        cuts = [i for i, ch in enumerate(merge) if ch == " " and merge[:i] in vocab and merge[i + 1 :] in vocab]
        if not cuts:
            raise ValueError(f"Cannot read the GGUF merge {merge!r}: it is not two vocabulary tokens split by a space.")
        pairs.append((merge[: cuts[0]], merge[cuts[0] + 1 :]))
    return pairs


def _unsupported(what: str) -> ValueError:
    """Build the error raised for a GGUF tokenizer this module cannot rebuild.

    Args:
        what: A sentence fragment naming the unsupported part.

    Returns:
        A ``ValueError`` with a message that names the problem and the way around it.
    """
    return ValueError(
        f"{what} is not supported by jaxspec's GGUF tokenizer, which rebuilds byte-level BPE ('gpt2') vocabularies "
        f"with the pre-tokenizers {sorted(SUPPORTED_PRE_TOKENIZERS)}, and the SentencePiece ('llama') vocabularies of "
        f"{', '.join(_SENTENCEPIECE_ARCHITECTURES)}. Pass a Hugging Face folder that contains "
        "tokenizer.json instead (for example the original model repository, downloaded beforehand)."
    )


def _special_token_ids(reader: GGUFFile, tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """Read the BOS/EOS/UNK/PAD ids, keeping only those that name a control, user-defined or unknown token.

    A special token is matched whole wherever it appears in the text. If the file points one of these roles at an
    ordinary vocabulary token (say ``"!"``), making it special would change how that text is cut, so the role is
    dropped with a warning instead.

    Args:
        reader: An open ``jaxspec.gguf_file.GGUFFile``.
        tokens: ``tokenizer.ggml.tokens``.
        token_types: ``tokenizer.ggml.token_type``.

    Returns:
        A dict from ``"bos"``, ``"eos"``, ``"unknown"``, ``"padding"`` (those present and usable) to the token id.
    """
    ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = reader.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            logger.warning("GGUF %s token id %d is outside the vocabulary; ignored.", name, token_id)
        elif token_types[token_id] not in (_CONTROL, _USER_DEFINED, _UNKNOWN):
            logger.warning("GGUF %s token %r is an ordinary token, not a special one; ignored.", name, tokens[token_id])
        else:
            ids[name] = int(token_id)
    return ids


def _template(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """Build the post-processor that adds BOS and/or EOS around each sequence.

    Args:
        bos: ``(token, id)`` of the BOS token to prepend, or ``None`` to add none.
        eos: ``(token, id)`` of the EOS token to append, or ``None`` to add none.

    Returns:
        A ``TemplateProcessing`` for single sequences and pairs.
    """
    before, after = ([bos] if bos else []), ([eos] if eos else [])
    single = [*(f"{t}:0" for t, _ in before), "$A:0", *(f"{t}:0" for t, _ in after)]
    pair = [*single, *(f"{t}:1" for t, _ in before), "$B:1", *(f"{t}:1" for t, _ in after)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[*before, *after])


def _open_reader(path_or_reader: str | os.PathLike | GGUFFile | gguf.GGUFReader) -> GGUFFile:
    """Open a GGUF file, or pass an already open one through.

    Args:
        path_or_reader: Path of a ``.gguf`` file, a ``jaxspec.gguf_file.GGUFFile``, or a ``gguf.GGUFReader`` (its
            file is read again with ``GGUFFile``).

    Returns:
        A ``GGUFFile``.

    Raises:
        FileNotFoundError: If the path does not exist.
    """
    from jaxspec.gguf_file import GGUFFile

    if isinstance(path_or_reader, GGUFFile):
        return path_or_reader
    if not isinstance(path_or_reader, (str, os.PathLike)):  # a gguf.GGUFReader: its memory map names the file
        path_or_reader = path_or_reader.data.filename
    path = os.fspath(path_or_reader)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No GGUF file at {path!r}.")
    return GGUFFile(path)


def tokenizer_from_gguf(path_or_reader: str | os.PathLike | GGUFFile | gguf.GGUFReader) -> PreTrainedTokenizerFast:
    """Build a Hugging Face fast tokenizer from the tokenizer metadata of a GGUF file.

    The BPE model gets the file's vocabulary and merges; the normalizer and pre-tokenizer follow
    ``tokenizer.ggml.pre``; the decoder is byte-level. Tokens typed CONTROL become special added tokens and tokens
    typed USER_DEFINED become plain added tokens, so both are matched whole in the text. BOS, EOS, UNK and PAD come
    from the ``tokenizer.ggml.*_token_id`` keys, whether BOS/EOS are added from ``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token``, and the chat template from ``tokenizer.chat_template``.

    Args:
        path_or_reader: Path of a ``.gguf`` file, an open ``jaxspec.gguf_file.GGUFFile``, or a ``gguf.GGUFReader``.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` whose ``encode``/``decode``/``apply_chat_template`` match the
        model's original tokenizer.

    Raises:
        FileNotFoundError: If the path does not exist.
        ValueError: If the file has no tokenizer, or a tokenizer model or pre-tokenizer that is not supported (for
            example a SentencePiece ``"llama"`` or a ``"t5"`` vocabulary).
    """
    reader = _open_reader(path_or_reader)
    model = reader.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError("This GGUF file has no tokenizer (no 'tokenizer.ggml.model' key).")
    architecture = reader.get("general.architecture")
    if model == "llama" and architecture in _SENTENCEPIECE_ARCHITECTURES:
        return _sentencepiece_tokenizer(reader)
    if model != "gpt2":
        raise _unsupported(f"The GGUF tokenizer model {model!r} (tokenizer.ggml.model) of a {architecture!r} model")
    pre = reader.get("tokenizer.ggml.pre")
    spec = SUPPORTED_PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise _unsupported(f"The GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")

    tokens, token_types = _tokens_and_types(reader)
    special_ids = _special_token_ids(reader, tokens, token_types)
    vocab = _byte_level_vocab(tokens, token_types, keep=set(special_ids.values()))
    merges = _parse_merges(reader.get("tokenizer.ggml.merges", []), vocab)

    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, ignore_merges=spec.ignore_merges)
    )
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    steps = []
    if spec.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=spec.split is None))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    byte_level = [processors.ByteLevel(trim_offsets=False)]
    return _wrap(reader, backend, tokens, token_types, special_ids, spec.add_bos, byte_level)


def _tokens_and_types(reader: GGUFFile) -> tuple[list[str], list[int]]:
    """``tokenizer.ggml.tokens`` and their llama.cpp types (all NORMAL when the file stores none)."""
    tokens: list[str] = reader.get("tokenizer.ggml.tokens")
    token_types: list[int] = reader.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but {len(token_types)} token types.")
    return tokens, token_types


# SentencePiece ("llama") vocabularies rebuilt for these architectures: Gemma's (no prefix space, byte fallback).
_SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _sentencepiece_tokenizer(reader: GGUFFile) -> PreTrainedTokenizerFast:
    """Gemma's SentencePiece BPE from a GGUF vocabulary: spaces become "▁", no space is prepended, bytes the
    vocabulary lacks fall back to its <0xXX> tokens. The file stores no merges: they are recovered from the
    vocabulary, where every piece of two or more characters is a merge of two shorter pieces, ranked by the piece's
    place in the file (Gemma's order of merges; its scores do not follow it). Runs of spaces, which the file spells
    with real spaces, are spelled with "▁" as the normalized text has them."""
    tokens, token_types = _tokens_and_types(reader)
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    special_ids = _special_token_ids(reader, tokens, token_types)
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []  # (left, right), ranked by the merged piece's place in the file, then its longer left part first
    for piece in tokens:  # in the file's order
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    unk = tokens[special_ids["unknown"]] if "unknown" in special_ids else None
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _wrap(reader, backend, tokens, token_types, special_ids, True, [])


def _wrap(reader, backend: Tokenizer, tokens: list[str], token_types: list[int], special_ids: dict[str, int],
          default_add_bos: bool, post_steps: list) -> PreTrainedTokenizerFast:
    """The parts every rebuilt GGUF tokenizer shares: control and user-defined tokens matched whole, BOS/EOS added
    as the file says (after `post_steps`), the chat template, all wrapped as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    # Added tokens are matched whole in the raw text before pre-tokenization; each keeps its id in the vocabulary.
    control = {index for index, token_type in enumerate(token_types) if token_type == _CONTROL}
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(control | set(special_ids.values()))]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, t in zip(tokens, token_types)
            if t == _USER_DEFINED
        ]
    )

    bos, eos, unk, pad = (
        tokens[special_ids[name]] if name in special_ids else None for name in ("bos", "eos", "unknown", "padding")
    )
    add_bos = bool(reader.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(reader.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    # transformers rebuilds the same template from add_bos_token/add_eos_token; setting it here keeps the bare
    # `tokenizers.Tokenizer` (backend_tokenizer) right on its own too.
    template = _template((bos, special_ids["bos"]) if add_bos else None, (eos, special_ids["eos"]) if add_eos else None)
    backend.post_processor = processors.Sequence([*post_steps, template])

    kwargs: dict[str, Any] = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    chat_template = reader.get("tokenizer.chat_template")
    if chat_template:
        kwargs["chat_template"] = chat_template
    name = reader.get("general.name")
    if name:
        kwargs["name_or_path"] = name
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in kwargs.items() if v is not None})


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a GGUF file or from a local Hugging Face folder.

    Args:
        path: A ``.gguf`` file (built with :func:`tokenizer_from_gguf`), or a folder holding a Hugging Face
            tokenizer (``tokenizer.json`` / ``tokenizer_config.json``), loaded with
            ``AutoTokenizer.from_pretrained(path, local_files_only=True)``. A folder with no tokenizer files but
            exactly one ``.gguf`` file uses that file.

    Returns:
        The tokenizer.

    Raises:
        FileNotFoundError: If ``path`` does not exist, or a folder holds neither tokenizer files nor one GGUF file.
        ValueError: If a GGUF file's tokenizer is not supported (see :func:`tokenizer_from_gguf`).
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic == b"GGUF":
            return tokenizer_from_gguf(path)
        raise ValueError(f"{path!r} is not a GGUF file; pass a .gguf file or a Hugging Face tokenizer folder.")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No tokenizer at {path!r}: expected a .gguf file or a Hugging Face folder.")
    if any(os.path.isfile(os.path.join(path, name)) for name in _HF_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(ggufs) == 1:
        return tokenizer_from_gguf(os.path.join(path, ggufs[0]))
    raise FileNotFoundError(
        f"The folder {path!r} holds no tokenizer.json or tokenizer_config.json"
        + (f" and several GGUF files {ggufs}; pass one of them." if ggufs else ".")
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool | None = None) -> list[int]:
    """Token ids of a user prompt: through the chat template (as one user turn, generation prompt added) when `chat`
    is true, or when it is None and the tokenizer has a template; as plain text otherwise."""
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; run without --chat (or with --no-chat).")
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(templated, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=True)
