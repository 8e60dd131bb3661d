"""The tokenizer of a training run (``data.tokenizer``): what Megatron's datasets read from one
(``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``) and what writing an indexed dataset needs
(``encode``: texts to arrays of token ids).

- ``byte``: the UTF-8 bytes 0..255 are the tokens, 256 ends a document (vocabulary 257).
- ``null``: Megatron-core's NullTokenizer (as megatron-core 0.19 defines it): the ids are the data
  (it tokenizes no text); ``data.vocab_size`` tokens, the end of a document is ``vocab_size - 1`` (or
  ``data.eod_id``), no padding token. (Megatron's older NullTokenizer(N), megatron-core <= 0.16 and
  Megatron-LM's legacy one, had N + 1 ids and ended documents with N: data made for it needs
  ``data.vocab_size=N+1``.)
- anything else: a Hugging Face tokenizer, through the ``tokenizers`` library (``pip install
  'primus-fp8-plugin[data]'``): a ``tokenizer.json`` file, a directory holding one (as
  ``save_pretrained`` writes it), or a hub name such as ``gpt2`` (downloaded once into the Hugging
  Face cache). Its vocabulary counts every id, added tokens included (``len(tokenizer)`` in
  ``transformers``); the end of a document is ``data.eod_id``, else the ``eos_token`` of its
  ``tokenizer_config.json``, else the first of ``END_OF_TEXT_TOKENS`` it has; its padding token is
  the config's ``pad_token`` (else none).

The model's embedding is ``vocab_size`` padded as Megatron pads (``training/model.padded_vocab``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from ..config.schema import ConfigError, check_tokenizer_fields, tokenizer_name

END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
NO_PAD = -1  # Megatron's datasets: no padding token


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; token 256 ends a document."""

    name = "byte"
    vocab_size = 257
    eod = 256
    eos = 256
    pad = NO_PAD
    unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 257}  # hashed into Megatron's index cache

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        """Each text's UTF-8 bytes (uint8 arrays; there are no special tokens to add)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron-core's NullTokenizer (``megatron.core.tokenizers``): ``vocab_size`` ids, end of
    document ``vocab_size - 1`` unless ``eod`` is given, no padding token; it has no text form."""

    def __init__(self, vocab_size: int, eod: int | None = None):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1 if eod is None else int(eod)
        self.eos = self.eod
        self.pad = NO_PAD
        self.name = f"null (data.vocab_size={self.vocab_size})"
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": self.vocab_size, "eod": self.eod}

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        raise ConfigError("data.tokenizer: null tokenizes no text (its ids are the data); name a real tokenizer")



class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (see the module docstring for how it is found and what
    its vocabulary, end of document and padding are)."""

    def __init__(self, name: str, eod: int | None = None):
        self.name = name
        self.tokenizer, config = _load_hf(name)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        self.eod = int(eod) if eod is not None else self._eod_from(config, vocab)
        pad = _token_content(config.get("pad_token"))
        self.pad = vocab.get(pad, NO_PAD) if pad else NO_PAD
        self.eos = self.eod
        self.unique_identifiers = {"class": "HFTokenizer", "name": name, "vocab_size": self.vocab_size, "eod": self.eod}

    def _eod_from(self, config: dict, vocab: dict[str, int]) -> int:
        eos = _token_content(config.get("eos_token"))
        if eos and eos in vocab:
            return vocab[eos]
        for token in END_OF_TEXT_TOKENS:
            if token in vocab:
                return vocab[token]
        raise ConfigError(
            f"data.tokenizer: {self.name!r} has no end-of-document token (no eos_token in a tokenizer_config.json "
            f"beside it, none of {', '.join(END_OF_TEXT_TOKENS)}); give its id as data.eod_id"
        )

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        """Token ids of each text (int64 arrays; the end-of-document id is not appended), with the special
        tokens the tokenizer's post-processor adds (e.g. Llama-3's ``<|begin_of_text|>``) unless
        ``add_special_tokens`` is false."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def _token_content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    return token.get("content") if isinstance(token, dict) else token


def _load_hf(name: str):
    """(tokenizers.Tokenizer, its tokenizer_config.json as a dict, or {}) for a file, a directory or a hub name."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"data.tokenizer: {name!r} is a Hugging Face tokenizer, which needs the tokenizers library: "
            "pip install 'primus-fp8-plugin[data]' (or data.tokenizer=byte / null)"
        ) from None
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"data.tokenizer: {name} has no tokenizer.json (a fast tokenizer, as save_pretrained writes it)")
    if path.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises plain Exceptions
            raise ConfigError(f"data.tokenizer: {path} is not a Hugging Face tokenizer.json ({err})") from None
        config_path = path.with_name("tokenizer_config.json")
        return tokenizer, json.loads(config_path.read_text()) if config_path.is_file() else {}
    if name.startswith((".", "/", "~")) or name.endswith(".json"):
        raise ConfigError(f"data.tokenizer: {name} not found (a tokenizer.json, a directory holding one, or a hub name)")
    try:
        tokenizer = Tokenizer.from_pretrained(name)
    except Exception as err:
        raise ConfigError(
            f"data.tokenizer: {name!r} is no local file or directory, and the Hugging Face hub did not give it "
            f"({type(err).__name__}: {err}); give a path to a tokenizer.json, or byte / null"
        ) from None
    return tokenizer, _hub_config(name)


def _hub_config(name: str) -> dict:
    """The hub repository's tokenizer_config.json ({} where it has none)."""
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(name, "tokenizer_config.json")).read_text())
    except Exception:  # optional: the end-of-document token then comes from END_OF_TEXT_TOKENS or data.eod_id
        return {}


@functools.lru_cache(maxsize=8)
def build_tokenizer(name: str | None, vocab_size: int | None = None, eod_id: int | None = None):
    """The tokenizer called ``name`` (byte, null or None, or a Hugging Face tokenizer), loaded once per
    process. Raises ConfigError naming data.tokenizer (or data.vocab_size / data.eod_id) when it
    cannot be had."""
    check_tokenizer_fields(name, vocab_size, eod_id)
    name = tokenizer_name(name)
    if name == "byte":
        return ByteTokenizer()
    if name == "null":
        return NullTokenizer(vocab_size, eod_id)
    tokenizer = HFTokenizer(name, eod_id)
    if not 0 <= tokenizer.eod < tokenizer.vocab_size:
        raise ConfigError(f"data.eod_id: {tokenizer.eod} is not an id of {name!r} (0..{tokenizer.vocab_size - 1})")
    return tokenizer


def run_tokenizer(cfg):
    """The tokenizer ``cfg.data`` names."""
    d = cfg.data
    return build_tokenizer(d.tokenizer, d.vocab_size, d.eod_id)
