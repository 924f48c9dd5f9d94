"""A token's own bytes and text (models/token_text.py) for byte-level BPE and SentencePiece
tokenizers: the bytes of a text's tokens put together are the text's bytes, spaces and split
characters included, where decoding each token alone loses them."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draftsmith.models.token_text import TokenText, byte_level_alphabet

TEXT = "true true café ß 世界"


def _byte_level() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = []
    for a, b in [("Ġ", "t"), ("Ġt", "r"), ("u", "e"), ("Ġtr", "ue")]:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def _sentencepiece() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{i:02X}>": 3 + i for i in range(256)}
    merges = []
    for a, b in [("▁", "t"), ("▁t", "r"), ("u", "e"), ("▁tr", "ue")]:
        for piece in (a, b, a + b):
            vocab.setdefault(piece, len(vocab))
        merges.append((a, b))
    for piece in ("c", "a", "f", "é"):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_the_byte_level_alphabet_is_gpt2s():
    table = byte_level_alphabet()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["a"] == ord("a") and table["Ċ"] == ord("\n")


@pytest.mark.parametrize("make,kind,lead", [(_byte_level, "byte-level", ""), (_sentencepiece, "sentencepiece", " ")])
def test_token_bytes_rebuild_the_text(make, kind, lead):
    tok = make()
    tt = TokenText(tok)
    assert tt.kind == kind
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tt.bytes(i) for i in ids) == (lead + TEXT).encode("utf-8")
    pieces = [tt.text(i) for i in ids]
    assert " true" in pieces  # its space kept (decoding the token alone drops it for SentencePiece)
    split = [i for i in ids if len(tt.bytes(i)) == 1 and tt.bytes(i)[0] >= 0x80]
    assert split and all(tt.text(i) == "\ufffd" for i in split)  # half a character: U+FFFD, exact bytes
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert tt.text(eos) == tok.eos_token


def test_the_default_targets_tokens(default_target_dir):
    from draftsmith.models.loading import load_tokenizer

    tok = load_tokenizer(default_target_dir)
    tt = TokenText(tok)
    ids = tok.encode("def f(x):\n    return 'héllo 世界'", add_special_tokens=False)
    assert tt.kind == "byte-level"
    assert b"".join(tt.bytes(i) for i in ids).decode("utf-8") == "def f(x):\n    return 'héllo 世界'"
    assert tt.text(tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
