"""Byte-level BPE tokenizer, stored as `tokenizer.json` with the `tokenizers` library.

Every string round-trips exactly: the 256 byte symbols are always in the vocabulary, merges only
shorten sequences, and special-token text typed by a user is encoded as ordinary bytes (a prompt
cannot smuggle in an end-of-sequence). Any local `tokenizer.json` can be loaded instead of ours.

Cost bounds, for a server that encodes what strangers send:
- `max_token_chars`: the most characters one token can stand for, so a text of C characters needs
  at least C / max_token_chars tokens; the gateway refuses a prompt that cannot fit the context by
  its length alone, before encoding it. (This holds for tokenizers that do not delete characters
  before tokenizing, i.e. have no normalizer: ours, and byte-level BPEs generally.)
- Encoding releases the GIL (the library's batch call), so a thread encoding a long text does not
  stop the other threads of the process (the gateway's event loop).
- A run of more than `chunk_chars` characters without a change between whitespace and
  non-whitespace is encoded in pieces of `chunk_chars`: the library's cost grows with the square of
  a pre-token's length (a long run of letters is one pre-token). Text is still exactly what the ids
  decode to; only such runs, never ordinary text, are tokenized differently from one whole-text call.
  Done only where encoding pieces separately is known to round-trip (no normalizer, no added
  prefix), checked once at load.

Called by bootstrap (training one), the engines (encode/decode) and the learner.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIALS = (PAD, BOS, EOS)  # ids 0, 1, 2 in a tokenizer we train
CHUNK_CHARS = 256  # the longest run encoded in one piece (at least 4 of the longest token)


class Tokenizer:
    def __init__(self, inner: HFTokenizer):
        self.inner = inner
        # User text is never parsed into special tokens.
        self.inner.encode_special_tokens = True
        vocab = inner.get_vocab(with_added_tokens=True)
        self.pad_id = vocab.get(PAD)
        self.bos_id = vocab.get(BOS)
        eos_id = vocab.get(EOS)
        if eos_id is None:
            raise ValueError(f"tokenizer has no end-of-sequence token {EOS!r}")
        self.eos_id: int = eos_id
        self._token_bytes: list[bytes] | None = None
        # Built now, not at a first request: the gateway checks prompt sizes with it before encoding.
        self.max_token_chars: int = max(1, *(len(b) for b in self.token_bytes))
        self.chunk_chars = max(CHUNK_CHARS, 4 * self.max_token_chars)
        n = self.chunk_chars + 1
        self._long_run = re.compile(rf"(?<!\S)\S{{{n},}}|(?<!\s)\s{{{n},}}")
        self._chunked = self._pieces_round_trip()

    @property
    def token_bytes(self) -> list[bytes]:
        """The raw bytes of every token id (special tokens: b""), built once: the engine's decode table."""
        if self._token_bytes is None:
            table = []
            for i in range(self.vocab_size):
                special = i in (self.pad_id, self.bos_id, self.eos_id)
                piece = self.inner.id_to_token(i)
                table.append(b"" if special or piece is None else self._piece_bytes(piece))
            self._token_bytes = table
        return self._token_bytes

    def _piece_bytes(self, piece: str) -> bytes:
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        token_id = self.inner.token_to_id(piece)
        if token_id is None:  # `piece` comes from `id_to_token`, so it has an id
            raise ValueError(f"token {piece!r} is not in the vocabulary")
        return self.inner.decode([token_id], skip_special_tokens=False).encode()

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a str, got {type(text).__name__}")
        return self.encode_batch([text])[0]

    def encode_prompt(self, text: str) -> list[int]:
        """How every product prompt becomes model input: BOS, then the text's tokens."""
        return self.encode_prompts([text])[0]

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        bos = [self.bos_id] if self.bos_id is not None else []
        return [bos + ids for ids in self.encode_batch(texts)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The tokens of each text, in one call of the library (which releases the GIL)."""
        if not self._chunked:
            return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=False)]
        pieces: list[str] = []
        counts: list[int] = []
        for text in texts:
            split = self._pieces(text)
            pieces += split
            counts.append(len(split))
        encoded = self.inner.encode_batch(pieces, add_special_tokens=False)
        out, at = [], 0
        for k in counts:
            out.append([t for e in encoded[at : at + k] for t in e.ids] if k != 1 else encoded[at].ids)
            at += k
        return out

    def _pieces(self, text: str) -> list[str]:
        """`text` cut inside every run longer than `chunk_chars` (see the module's docstring)."""
        n = self.chunk_chars
        if len(text) <= n:
            return [text]
        pieces, start = [], 0
        for m in self._long_run.finditer(text):
            for cut in range(m.start() + n, m.end(), n):
                pieces.append(text[start:cut])
                start = cut
        pieces.append(text[start:])
        return pieces

    def _pieces_round_trip(self) -> bool:
        """Whether texts encoded in pieces decode to the pieces joined (no normalizer, no prefix
        added to each piece)."""
        if self.inner.normalizer is not None:
            return False
        probe = ["ab ", "cd", "\n x", "y"]
        encoded = self.inner.encode_batch(probe, add_special_tokens=False)
        ids = [t for e in encoded for t in e.ids]
        return self.inner.decode(ids, skip_special_tokens=False) == "".join(probe)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self.inner.decode(list(ids), skip_special_tokens=True)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids` (a partial UTF-8 character stays partial), for streaming."""
        table = self.token_bytes
        try:
            return b"".join(table[i] for i in ids)
        except IndexError:
            bad = next(i for i in ids if not 0 <= i < len(table))
            raise ValueError(f"token id {bad} is not in the vocabulary") from None

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.inner.save(str(folder / "tokenizer.json"))
        # What transformers' AutoTokenizer (and so vLLM) needs besides tokenizer.json.
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 20,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        (folder / "special_tokens_map.json").write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2)
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: tokenizer file missing")
        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for bad JSON
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        return cls(inner)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, spell_quoted_strings: bool = False) -> Tokenizer:
    """Train a byte-level BPE on `texts` (deterministic for the same texts and size).

    spell_quoted_strings: lowercase letters in a run that ends at a single quote (the letters of
    'ab' in `s.count('ab')`) are tokens of their own, as digits always are. A string literal is then
    spelled with the same 26 letter tokens wherever it appears, so one never seen in training is
    still made of tokens that were. Off by default; the demo's bootstrap turns it on.
    """
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIALS)} (bytes + specials), got {vocab_size}")
    inner = HFTokenizer(models.BPE())
    # Digits stand alone, so a number reads the same wherever it appears (copying a constant from the
    # prompt into code is then the same token); then GPT-2's byte-level split.
    spell = [pre_tokenizers.Split(Regex("[a-z](?=[a-z]*')"), "isolated")] if spell_quoted_strings else []
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            *spell,
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(inner)


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable-unicode table used by the ByteLevel pre-tokenizer."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER
