"""One token's own bytes and text, for log probabilities (`Logprob.decoded_token`, the API's
`token` and `bytes`).

Decoding a token alone loses what a tokenizer adds or merges across tokens: a SentencePiece
piece "▁true" decodes to "true" (its space is dropped at the start of a text), and a token that
holds half of a UTF-8 character decodes to U+FFFD. So the bytes come from the token's piece:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): every character of a piece stands for one byte
  (GPT-2's alphabet: printable Latin-1 bytes for themselves, the other 68 bytes for U+0100.. in
  byte order);
- SentencePiece (Llama 2, Gemma, Mistral): "▁" is a space and a `<0xNN>` piece is that byte;
- added and special tokens: their text;
- any other tokenizer: its decoding of the token alone.

`text(id)` is those bytes as UTF-8, with U+FFFD where a character continues in another token.
"""

from __future__ import annotations

import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _kind(tokenizer) -> str:
    """"byte-level", "sentencepiece" or "decode" (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
        if '"ByteLevel"' in decoder:
            return "byte-level"
        if '"Metaspace"' in decoder or '"ByteFallback"' in decoder or "\u2581" in decoder or "\\u2581" in decoder:
            return "sentencepiece"
        return "decode"
    return "sentencepiece" if hasattr(tokenizer, "sp_model") else "decode"


class TokenText:
    """Token id -> its bytes and text, cached (one per tokenizer; not shared across threads
    with a tokenizer another thread uses)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.kind = _kind(tokenizer)
        self._alphabet = byte_level_alphabet() if self.kind == "byte-level" else {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(int(token_id))
        return b

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self.kind != "decode":
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self.kind == "byte-level" and all(ch in self._alphabet for ch in piece):
                    return bytes(self._alphabet[ch] for ch in piece)
                if self.kind == "sentencepiece":
                    m = _BYTE_PIECE.fullmatch(piece)
                    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
