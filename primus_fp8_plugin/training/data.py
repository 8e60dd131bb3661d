"""Training data: a byte-level tokenizer, the offline default corpus (Python's own standard-library
sources), written once into Megatron's indexed-dataset format, and Megatron's GPTDataset over it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; token 256 ends a document. What Megatron's datasets read
    (``vocab_size``, ``eod``, ``eos``); ``pad`` is left to Megatron's default."""

    vocab_size = 257
    eod = 256
    eos = 256
    unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 257}  # hashed into Megatron's index cache

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """This Python's standard-library ``.py`` files (sorted: the corpus is the same on every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def build_stdlib_corpus(cache_dir: str | Path, max_bytes: int, log=print) -> str:
    """Tokenize standard-library sources (up to ``max_bytes``) into ``<cache_dir>/stdlib_<hash>.{bin,idx}``
    once; later calls reuse it. Returns the dataset prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    files = stdlib_files()
    if not files:
        raise RuntimeError(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}")
    key = hashlib.sha1(f"{len(files)}:{max_bytes}:{files[0]}:{files[-1]}".encode()).hexdigest()[:10]
    prefix = Path(cache_dir) / f"stdlib_{key}"
    if prefix.with_suffix(".idx").exists() and prefix.with_suffix(".bin").exists():
        return str(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + ".tmp")
    builder = IndexedDatasetBuilder(str(tmp.with_suffix(".bin")), dtype=np.uint16)
    total = docs = 0
    for path in files:
        data = path.read_bytes()
        if not data:
            continue
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        doc = np.concatenate([ids, np.array([ByteTokenizer.eod], dtype=np.uint16)])
        builder.add_document(torch.from_numpy(doc.astype(np.int64)), [doc.size])
        total += doc.size
        docs += 1
        if total >= max_bytes:
            break
    builder.finalize(str(tmp.with_suffix(".idx")))
    tmp.with_suffix(".bin").rename(prefix.with_suffix(".bin"))
    tmp.with_suffix(".idx").rename(prefix.with_suffix(".idx"))
    log(f"[data] wrote {prefix} ({docs} files, {total / 1e6:.1f} M tokens)")
    return str(prefix)


def _check_split_has_documents(prefix: str, split: str, sizes: list[int]) -> None:
    """Megatron's GPTDataset loops forever on a split with no tokens (it counts epochs until the
    requested samples fit); refuse that up front. Documents go to splits as Megatron's builder assigns
    them: split-matrix book-ends times the document count, each rounded."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from ..config import ConfigError

    n_docs = len(IndexedDataset(prefix))
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for name, ends, want in zip(("train", "valid", "test"), matrix, sizes, strict=False):
        n = 0 if ends is None else int(round(ends[1] * float(n_docs))) - int(round(ends[0] * float(n_docs)))
        if want and n <= 0:
            raise ConfigError(
                f"data.split={split!r}: the {name} split of {prefix} gets none of its {n_docs} documents "
                f"but {want} samples are asked of it; use a larger corpus (data.max_bytes) or change data.split"
            )


def build_datasets(prefix: str, seq_length: int, seed: int, split: str, sizes: list[int], cache_dir: str):
    """Megatron's (train, valid, test) GPTDatasets over an indexed dataset prefix."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    _check_split_has_documents(prefix, split, sizes)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(Path(cache_dir) / "index_cache"),
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def batches(dataset, micro_batch_size: int, start_sample: int = 0, device="cpu") -> Iterator[dict]:
    """Micro-batches in dataset order from ``start_sample`` (so a resumed run sees the same data)."""
    i = start_sample
    while True:
        yield _collate(dataset, i, micro_batch_size, device)
        i += micro_batch_size


def rank_batches(
    dataset, micro_batch_size: int, n_micro: int, global_batch_size: int, start_sample: int, dp_rank: int, device="cpu"
) -> Iterator[dict]:
    """This data-parallel rank's micro-batches: global batch ``k`` is samples
    ``[start + k*G, start + (k+1)*G)`` in dataset order (``G = global_batch_size``); rank ``r`` takes
    the ``n_micro`` micro-batches of ``micro_batch_size`` samples that begin at
    ``start + k*G + r*n_micro*micro_batch_size``. Every sample is used once per pass, whatever the
    split into ranks and micro-batches, and a run resumed at ``start = consumed samples`` continues
    with the same samples."""
    base = start_sample + dp_rank * n_micro * micro_batch_size
    while True:
        for j in range(n_micro):
            yield _collate(dataset, base + j * micro_batch_size, micro_batch_size, device)
        base += global_batch_size


def _collate(dataset, start: int, micro_batch_size: int, device) -> dict:
    n = len(dataset)
    items = [dataset[(start + j) % n] for j in range(micro_batch_size)]
    return {
        k: torch.stack([torch.as_tensor(it[k]) for it in items]).to(device)
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }
