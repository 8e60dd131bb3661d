"""Training data: Megatron's indexed-dataset format (written from tokenized documents, its largest
token id read back and checked against the run's tokenizer), the offline default corpus (Python's own
standard-library sources, tokenized once), and Megatron's GPTDataset over an indexed dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..config.schema import ConfigError
from .tokenizer import ByteTokenizer

# ids scanned per chunk of a .bin (32 Mi ids: 64-128 MiB of memory), and the size from which the scan shows progress
SCAN_CHUNK = 1 << 25
SCAN_PROGRESS_BYTES = 1 << 30
# Megatron's GPTDataset counts passes over a split one at a time and indexes each: more are refused
MAX_PASSES = 1_000_000
# the train.* field whose value sets the samples drawn from each split
SPLIT_FIELDS = {"train": "train.steps", "valid": "train.eval_steps"}


class IndexedDatasetWriter:
    """Documents (arrays of token ids) into ``<prefix>.bin``/``<prefix>.idx``, Megatron's indexed
    format (through its ``IndexedDatasetBuilder``). Ids are stored as uint16 below a vocabulary of
    65,500 tokens, else int32 (Megatron's ``DType.optimal_dtype``). Both files are written under
    temporary names and renamed into place by ``close``, so a prefix is never half-written; an
    exception inside ``with`` removes them. Counts ``documents``, ``tokens`` and the ``largest`` id."""

    def __init__(self, prefix: str | Path, vocab_size: int):
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix = Path(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = DType.optimal_dtype(self.vocab_size)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.prefix.with_name(f"{self.prefix.name}.tmp{os.getpid()}")
        self._builder = IndexedDatasetBuilder(str(self._tmp) + ".bin", dtype=self.dtype)
        self.documents = self.tokens = 0
        self.largest = -1

    def add(self, ids: np.ndarray) -> None:
        """One document: ``ids``, a 1-D integer array, every id in ``[0, vocab_size)``."""
        ids = np.asarray(ids)
        if ids.size == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} outside the vocabulary [0, {self.vocab_size})")
        self._builder.add_document(torch.from_numpy(ids.astype(np.int64, copy=False)), [ids.size])
        self.documents += 1
        self.tokens += ids.size
        self.largest = max(self.largest, high)

    def add_texts(self, tokenizer, texts: list[str], add_special_tokens: bool = True) -> None:
        """Each text one document: its ids under ``tokenizer`` (with the special tokens its
        post-processor adds, unless ``add_special_tokens`` is false), then the end-of-document id
        (not twice where the ids end with it already). Empty texts are skipped."""
        eod = np.array([tokenizer.eod], dtype=np.int64)
        for ids in tokenizer.encode([t for t in texts if t], add_special_tokens=add_special_tokens):
            ids = ids.astype(np.int64, copy=False)
            self.add(ids if ids.size and ids[-1] == tokenizer.eod else np.concatenate([ids, eod]))

    def close(self) -> None:
        self._builder.finalize(str(self._tmp) + ".idx")
        # an older index goes first: never a new .bin with the old .idx, whatever stops between the renames
        Path(str(self.prefix) + ".idx").unlink(missing_ok=True)
        os.replace(str(self._tmp) + ".bin", str(self.prefix) + ".bin")
        os.replace(str(self._tmp) + ".idx", str(self.prefix) + ".idx")

    def discard(self) -> None:
        self._builder.data_file.close()
        for suffix in (".bin", ".idx"):
            Path(str(self._tmp) + suffix).unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()


def token_dtype(prefix: str) -> np.dtype:
    """The dtype of the ids in ``<prefix>.bin``, as ``<prefix>.idx`` records it (Megatron's header: 9
    magic bytes, an 8-byte version, a 1-byte dtype code)."""
    from megatron.core.datasets.indexed_dataset import DType

    with open(prefix + ".idx", "rb") as f:
        head = f.read(18)
    if len(head) < 18:
        raise ConfigError(f"data.path: {prefix}.idx is truncated (no dtype in its header)")
    return np.dtype(DType.dtype_from_code(head[17]))


def token_id_range(prefix: str, cache_dir: str | Path | None = None, progress: bool = True) -> tuple[int, int]:
    """(most negative id or 0, largest id) of ``<prefix>.bin``, read through a memory map in chunks of
    ``SCAN_CHUNK`` ids, with a progress bar (stderr) for files of ``SCAN_PROGRESS_BYTES`` and more.
    With ``cache_dir`` the answer is kept in ``<cache_dir>/token_ids/`` and reused while the ``.bin``
    has the same path, size and modification time. An empty ``.bin``: (0, -1)."""
    bin_path = Path(prefix + ".bin").resolve()
    stat = bin_path.stat()
    key = {"bin": str(bin_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / "token_ids" / (hashlib.sha1(str(bin_path).encode()).hexdigest()[:16] + ".json")
        try:
            saved = json.loads(cache.read_text())
            if {k: saved.get(k) for k in key} == key:
                return int(saved["smallest"]), int(saved["largest"])
        except (OSError, ValueError, KeyError):
            pass  # no answer kept yet (or an unreadable one): scan
    dtype = token_dtype(prefix)
    count = stat.st_size // dtype.itemsize
    low, high = 0, -1
    if count:
        ids = np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
        bar = None
        if progress and stat.st_size >= SCAN_PROGRESS_BYTES:
            from tqdm import tqdm

            bar = tqdm(total=stat.st_size, unit="B", unit_scale=True, desc=f"[data] largest token id of {bin_path.name}")
        for start in range(0, count, SCAN_CHUNK):
            chunk = ids[start : start + SCAN_CHUNK]
            high = max(high, int(chunk.max()))
            if dtype.kind == "i":  # unsigned ids cannot be negative
                low = min(low, int(chunk.min()))
            if bar is not None:
                bar.update(chunk.size * dtype.itemsize)
        if bar is not None:
            bar.close()
        del ids
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({**key, "smallest": low, "largest": high}))
        os.replace(tmp, cache)
    return low, high


def check_token_ids(prefix: str, tokenizer, cache_dir: str | Path | None = None) -> tuple[int, int]:
    """Every id in ``<prefix>.bin`` is one of ``tokenizer``'s (``[0, vocab_size)``); else ConfigError
    naming data.tokenizer (data.vocab_size for the null tokenizer) and the vocabulary the data needs.
    Collective under torch.distributed: rank 0 reads the ids, every rank checks its answer (so every
    rank stops alike). Returns (smallest, largest) id."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [token_id_range(prefix, cache_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        low, high = box[0]
    else:
        low, high = token_id_range(prefix, cache_dir)
    if low < 0:
        raise ConfigError(f"data.path: {prefix}.bin holds negative ids (down to {low}): it is not token data")
    vocab = tokenizer.vocab_size
    if high >= vocab:
        fix = f"data.tokenizer=null data.vocab_size={high + 1} (or the vocabulary size of the tokenizer that made it)"
        if tokenizer.name.startswith("null"):
            older = f" (Megatron's older NullTokenizer({vocab}) ended documents with {vocab})" if high == vocab else ""
            raise ConfigError(
                f"data.vocab_size: {prefix}.bin holds token ids up to {high}, but data.tokenizer=null with "
                f"data.vocab_size={vocab} allows 0..{vocab - 1}; set data.vocab_size to at least {high + 1} "
                f"(the vocabulary of the tokenizer that made the data){older}"
            )
        raise ConfigError(
            f"data.tokenizer: {prefix}.bin holds token ids up to {high}, but data.tokenizer={tokenizer.name} has a "
            f"vocabulary of {vocab} (ids 0..{vocab - 1}): the data was made with another tokenizer; name it "
            f"(data.tokenizer=NAME or PATH), or use {fix}"
        )
    return low, high


def stdlib_files() -> list[Path]:
    """This Python's standard-library ``.py`` files (sorted: the corpus is the same on every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def build_stdlib_corpus(cache_dir: str | Path, max_bytes: int, log=print, tokenizer=None) -> str:
    """Tokenize standard-library sources (files in order until ``max_bytes`` of source are read; each
    file a document ending in the end-of-document token; invalid UTF-8 replaced by U+FFFD) with
    ``tokenizer`` (default: bytes) into ``<cache_dir>/stdlib_<hash>.{bin,idx}`` once; later calls
    reuse it. Returns the dataset prefix."""
    tokenizer = tokenizer or ByteTokenizer()
    files = stdlib_files()
    if not files:
        raise RuntimeError(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}")
    identity = json.dumps(tokenizer.unique_identifiers, sort_keys=True)
    key = hashlib.sha1(f"v2:{len(files)}:{max_bytes}:{files[0]}:{files[-1]}:{identity}".encode()).hexdigest()[:10]
    prefix = Path(cache_dir) / f"stdlib_{key}"
    if prefix.with_suffix(".idx").exists() and prefix.with_suffix(".bin").exists():
        return str(prefix)
    texts, read = [], 0
    for path in files:
        data = path.read_bytes()
        if data:
            texts.append(data.decode("utf-8", errors="replace"))
            read += len(data)
        if read >= max_bytes:
            break
    with IndexedDatasetWriter(prefix, tokenizer.vocab_size) as out:
        for start in range(0, len(texts), 64):
            out.add_texts(tokenizer, texts[start : start + 64])
    log(f"[data] wrote {prefix} ({out.documents} files, {out.tokens / 1e6:.1f} M tokens of {tokenizer.name})")
    return str(prefix)


def check_splits(prefix: str, split: str, sizes: list[int], seq_length: int, available_bytes: int | None = None) -> None:
    """Refuse up front what Megatron's GPTDataset builder would loop forever on or run out of memory
    over (it counts passes over a split one at a time until the samples asked of it fit, then indexes
    every pass). Documents go to splits as its builder assigns them: split-matrix book-ends times the
    document count, each rounded. Refused: a split with a share but no tokens (even with no samples
    asked of it), more than ``MAX_PASSES`` passes over a split, and indices larger than
    ``available_bytes`` (per split at least 4 bytes a document a pass, the document index, and 12
    bytes a sample, the sample and shuffle indices)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    lengths = np.array(dataset.sequence_lengths, dtype=np.int64)  # a copy: the index's memory map closes with it
    del dataset
    n_docs = len(lengths)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    need: dict[str, tuple[int, int]] = {}
    for name, ends, want in zip(("train", "valid", "test"), matrix, sizes, strict=False):
        if ends is None:
            continue
        begin, end = int(round(ends[0] * float(n_docs))), int(round(ends[1] * float(n_docs)))
        tokens = int(np.sum(lengths[begin:end], dtype=np.int64))
        if tokens <= 0:
            asked = f"{want} samples are asked of it" if want else "Megatron's dataset builder loops forever on an empty split"
            raise ConfigError(
                f"data.split={split!r}: the {name} split of {prefix} gets none of its {n_docs} documents but {asked}; "
                "use a larger corpus (data.max_bytes) or change data.split (a share of 0 leaves a split out)"
            )
        if not want:
            continue
        field = SPLIT_FIELDS.get(name, "data.split")
        passes = math.ceil((want * seq_length + 1) / tokens)
        if passes > MAX_PASSES:
            raise ConfigError(
                f"{field}: the run asks for {want} {name} samples of {seq_length} tokens, {passes} passes over the "
                f"{tokens} tokens of the {name} split of {prefix} (at most {MAX_PASSES} are built); lower {field} "
                "or use more data"
            )
        need[name] = (passes * (end - begin) * 4 + want * 12, want)
    total = sum(b for b, _ in need.values())
    if available_bytes is not None and total > available_bytes:
        name = max(need, key=lambda k: need[k][0])
        field = SPLIT_FIELDS.get(name, "data.split")
        also = " (or evaluate less often: train.eval_interval)" if name == "valid" else ""
        raise ConfigError(
            f"{field}: Megatron's dataset index of the {need[name][1]} {name} samples the run asks for needs at least "
            f"{total / 2**30:.3g} GiB of host memory, and {available_bytes / 2**30:.3g} GiB are available; lower {field}{also}"
        )


def build_datasets(prefix: str, seq_length: int, seed: int, split: str, sizes: list[int], cache_dir: str, tokenizer=None):
    """Megatron's (train, valid, test) GPTDatasets over an indexed dataset prefix; ``sizes``: the
    samples asked of each split; ``tokenizer``: the run's (end of document, padding; default bytes)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from ..config.resources import available_memory

    check_splits(prefix, split, sizes, seq_length, available_memory(torch.device("cpu"))[0])
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        tokenizer=tokenizer or ByteTokenizer(),
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
