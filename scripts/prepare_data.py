#!/usr/bin/env python3
"""Turn text files into a Megatron indexed dataset (``OUT.bin``/``OUT.idx``) with a real tokenizer,
for ``python -m primus_fp8_plugin.train data=indexed data.path=OUT data.tokenizer=TOKENIZER``.

    python scripts/prepare_data.py --tokenizer gpt2 --out data/corpus notes.txt books/ docs.jsonl
    python scripts/prepare_data.py --tokenizer path/to/tokenizer.json --out data/corpus corpus.jsonl

Inputs: plain-text files (each one document), JSONL files (``.jsonl``, ``.json``: one JSON object a
line, the document in its ``text`` field; ``--json-key`` names another) and directories (their
``.txt``, ``.md``, ``.jsonl`` and ``.json`` files, recursively, in sorted order). Each document's ids
are followed by the tokenizer's end-of-document id (not twice where its post-processor ends them
with it); empty documents are skipped. ``--tokenizer``: ``byte`` or a Hugging Face tokenizer (a
``tokenizer.json``, a directory holding one, or a hub name), as ``data.tokenizer`` takes it; Hugging
Face tokenizers need ``pip install 'primus-fp8-plugin[data]'``. Progress (bytes read) on stderr, a
summary at the end (documents, tokens, vocabulary, largest id, the files written). Exit status 2 for
bad input (a missing file, a tokenizer that cannot be had, a JSONL line that is not an object with the
key); nothing is left at ``OUT`` then.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")


class InputError(ValueError):
    """An input that cannot be read as documents (the message names the file and line)."""


def input_files(paths: list[str]) -> list[Path]:
    files = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not found:
                raise InputError(f"{path}: a directory without {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"{path}: no such file or directory")
    return files


def documents(path: Path, json_key: str, progress) -> Iterator[str]:
    """The documents of one input file; ``progress(n)`` is told the bytes read."""
    if path.suffix not in JSONL_SUFFIXES:
        data = path.read_bytes()
        progress(len(data))
        yield data.decode("utf-8", errors="replace")
        return
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            progress(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                raise InputError(f"{path}:{number}: not a JSON object with a string {json_key!r} field (--json-key)")
            yield record[json_key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("inputs", nargs="+", help="text files, JSONL files, directories")
    parser.add_argument("--tokenizer", required=True,
                        help="byte, or a Hugging Face tokenizer (tokenizer.json, a directory holding one, a hub name)")
    parser.add_argument("--out", required=True, help="the output prefix: writes OUT.bin and OUT.idx")
    parser.add_argument("--json-key", default="text", help="the JSONL field holding the document (default: text)")
    parser.add_argument("--eod-id", type=int, default=None, help="the end-of-document id (default: the tokenizer's)")
    parser.add_argument("--no-special-tokens", action="store_true",
                        help="leave out the special tokens the tokenizer's post-processor adds (e.g. a BOS token)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=256, help="documents tokenized together (default 256)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "primus_fp8_plugin").is_dir():  # the package of this script's checkout, installed or not
        sys.path.insert(0, str(checkout))
    from primus_fp8_plugin.config import ConfigError
    from primus_fp8_plugin.training.data import IndexedDatasetWriter
    from primus_fp8_plugin.training.tokenizer import build_tokenizer

    try:
        if args.tokenizer == "null":
            raise ConfigError("--tokenizer: null tokenizes no text (its ids are the data); name a real tokenizer")
        if args.batch < 1:
            raise ConfigError("--batch: must be >= 1")
        tokenizer = build_tokenizer(args.tokenizer, None, args.eod_id)
        files = input_files(args.inputs)
    except (ConfigError, InputError) as err:
        message = str(err).replace("data.tokenizer:", "--tokenizer:").replace("data.eod_id:", "--eod-id:")
        print(f"error: {message}", file=sys.stderr)
        return 2

    total = sum(f.stat().st_size for f in files)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="[prepare_data] tokenizing", file=sys.stderr)
    advance = bar.update if bar is not None else (lambda n: None)
    special = not args.no_special_tokens
    try:
        with IndexedDatasetWriter(args.out, tokenizer.vocab_size) as out:
            batch: list[str] = []
            for path in files:
                for text in documents(path, args.json_key, advance):
                    batch.append(text)
                    if len(batch) >= args.batch:
                        out.add_texts(tokenizer, batch, special)
                        batch = []
            out.add_texts(tokenizer, batch, special)
            if not out.documents:
                raise InputError(f"no documents in {', '.join(map(str, files))} (all empty)")
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    dtype = out.dtype.__name__
    print(f"[prepare_data] {out.documents} documents, {out.tokens} tokens ({total / max(out.tokens, 1):.2f} bytes a token) "
          f"from {len(files)} files; tokenizer {tokenizer.name}: vocabulary {tokenizer.vocab_size}, end of document "
          f"{tokenizer.eod}, largest id {out.largest} ({dtype})")  # fmt: skip
    eod = f" data.eod_id={args.eod_id}" if args.eod_id is not None else ""
    print(f"[prepare_data] wrote {args.out}.bin and {args.out}.idx; train on it with: "
          f"data=indexed data.path={args.out} data.tokenizer={args.tokenizer}{eod}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
