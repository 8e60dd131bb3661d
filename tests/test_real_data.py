"""Real data: the tokenizers a run names (byte, Megatron's null, a Hugging Face tokenizer from a local
file), the indexed-dataset writer and the read-back of the largest token id, the start-up check of
the data against the vocabulary, scripts/prepare_data.py, and a 32k-vocabulary dataset that trains
with ``data.tokenizer=null data.vocab_size=32000`` and stops with exit 2 without it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from primus_fp8_plugin.config import ConfigError  # noqa: E402
from primus_fp8_plugin.training import data as data_mod  # noqa: E402
from primus_fp8_plugin.training.tokenizer import ByteTokenizer, NullTokenizer, build_tokenizer  # noqa: E402

from .test_train import ROOT, losses, train  # noqa: E402

EOT = "<|endoftext|>"


def write_dataset(prefix, documents, vocab_size):
    with data_mod.IndexedDatasetWriter(prefix, vocab_size) as out:
        for doc in documents:
            out.add(np.asarray(doc))
    return out


def read_dataset(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [np.array(dataset[i]) for i in range(len(dataset))]


@pytest.fixture(scope="module")
def local_tokenizer(tmp_path_factory):
    """A small BPE tokenizer trained here and saved as tokenizer.json (no hub: CI has no network)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", EOT, "<pad>"], show_progress=False)
    text = ["def f(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog"] * 50
    tok.train_from_iterator(text, trainer=trainer)
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    return directory, tok


def test_null_tokenizer_follows_megatron():
    ours = NullTokenizer(32000)
    assert (ours.vocab_size, ours.eod, ours.pad) == (32000, 31999, -1)
    try:
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as MegatronNull
    except ImportError:
        MegatronNull = None
    theirs = MegatronNull(32000) if MegatronNull is not None else None
    if theirs is not None and theirs.vocab_size == 32000:  # megatron-core 0.19's (0.16's had 32001 ids, EOD 32000)
        assert (ours.vocab_size, ours.eod, ours.pad) == (theirs.vocab_size, theirs.eod, theirs.pad_id)
    assert NullTokenizer(32000, eod=0).eod == 0
    assert build_tokenizer("null", 32000) is build_tokenizer("null", 32000)  # loaded once
    with pytest.raises(ConfigError, match="data.vocab_size: data.tokenizer=null needs the vocabulary size"):
        build_tokenizer("null")
    with pytest.raises(ConfigError, match="data.eod_id: the byte tokenizer ends a document with 256"):
        build_tokenizer("byte", None, 3)


def test_hugging_face_tokenizer_from_a_local_file(local_tokenizer):
    directory, tok = local_tokenizer
    for name in (str(directory), str(directory / "tokenizer.json")):
        t = build_tokenizer(name)
        assert t.vocab_size == tok.get_vocab_size() == len(tok.get_vocab())
        assert t.eod == tok.token_to_id(EOT) and t.pad == -1  # no tokenizer_config.json: the usual end-of-text token
        ids = t.encode(["def f(x): return x"])[0]
        assert ids.tolist() == tok.encode("def f(x): return x").ids and t.detokenize(ids) == "def f(x): return x"
    # a tokenizer_config.json beside it names the end of document and the padding token
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}, "pad_token": "<pad>"}))
    try:
        t = build_tokenizer(str(directory / "tokenizer.json"), None, None)
        assert t.eod == tok.token_to_id("<unk>") and t.pad == tok.token_to_id("<pad>")
        assert build_tokenizer(str(directory), None, 2).eod == 2  # data.eod_id wins
    finally:
        (directory / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="data.eod_id: 300 is not an id of"):
        build_tokenizer(str(directory), None, 300)


def test_hugging_face_tokenizer_errors(local_tokenizer, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models

    with pytest.raises(ConfigError, match=f"data.tokenizer: {tmp_path / 'nope.json'} not found"):
        build_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(str(tmp_path / "bad.json"))
    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ConfigError, match="has no end-of-document token .* give its id as data.eod_id"):
        build_tokenizer(str(tmp_path / "plain.json"))
    assert build_tokenizer(str(tmp_path / "plain.json"), None, 1).eod == 1
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # not installed
    with pytest.raises(ConfigError, match=r"needs the tokenizers library: pip install 'primus-fp8-plugin\[data\]'"):
        build_tokenizer(str(tmp_path / "other.json"))


@pytest.mark.parametrize("vocab_size, dtype", [(257, np.uint16), (32000, np.uint16), (100_000, np.int32)])
def test_writer_round_trip_and_largest_id(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, size=n) for n in (5, 1, 300, 77)]
    docs[2][17] = vocab_size - 1
    out = write_dataset(tmp_path / "d", docs, vocab_size)
    assert (out.documents, out.tokens, out.largest) == (4, 383, vocab_size - 1)
    assert data_mod.token_dtype(str(tmp_path / "d")) == np.dtype(dtype)
    assert all(np.array_equal(a, b) for a, b in zip(read_dataset(tmp_path / "d"), docs, strict=True))
    assert not list(tmp_path.glob("*.tmp*"))  # the temporary files were renamed into place
    assert data_mod.token_id_range(str(tmp_path / "d")) == (0, int(np.concatenate(docs).max()))
    with pytest.raises(ValueError, match=f"token id {vocab_size} outside the vocabulary"):
        write_dataset(tmp_path / "e", [[1, vocab_size]], vocab_size)
    assert not list(tmp_path.glob("e*")) and not list(tmp_path.glob("*.tmp*"))  # nothing left behind


def test_largest_id_scan_in_chunks_with_progress_and_cache(tmp_path, monkeypatch, capsys):
    prefix = str(tmp_path / "d")
    write_dataset(prefix, [np.arange(1000) % 500, [499, 12]], 500)
    monkeypatch.setattr(data_mod, "SCAN_CHUNK", 64)  # 16 chunks
    monkeypatch.setattr(data_mod, "SCAN_PROGRESS_BYTES", 1)
    cache = tmp_path / "cache"
    assert data_mod.token_id_range(prefix, cache) == (0, 499)
    assert "largest token id of d.bin" in capsys.readouterr().err
    (entry,) = (cache / "token_ids").iterdir()
    saved = json.loads(entry.read_text())
    assert saved["largest"] == 499 and saved["size"] == 1002 * 2
    # the cached answer is used while the .bin's size and modification time stay: a doctored one shows it
    entry.write_text(json.dumps({**saved, "largest": 7}))
    assert data_mod.token_id_range(prefix, cache) == (0, 7)
    write_dataset(prefix, [[3, 600]], 1000)  # rewritten: another size and time, so scanned again
    assert data_mod.token_id_range(prefix, cache) == (0, 600)
    # negative ids (signed storage) are found
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "neg.bin"), dtype=np.int32)
    builder.add_document(torch.tensor([5, -3, 9]), [3])
    builder.finalize(str(tmp_path / "neg.idx"))
    assert data_mod.token_id_range(str(tmp_path / "neg")) == (-3, 9)
    with pytest.raises(ConfigError, match="data.path: .*neg.bin holds negative ids"):
        data_mod.check_token_ids(str(tmp_path / "neg"), NullTokenizer(100))


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_tokenizer(tmp_path):
    prefix = str(tmp_path / "d")
    write_dataset(prefix, [[0, 31999, 5]], 32000)
    assert data_mod.check_token_ids(prefix, NullTokenizer(32000)) == (0, 31999)
    with pytest.raises(ConfigError) as err:
        data_mod.check_token_ids(prefix, ByteTokenizer())
    assert str(err.value).startswith(f"data.tokenizer: {prefix}.bin holds token ids up to 31999, but data.tokenizer=byte")
    assert "data.tokenizer=null data.vocab_size=32000" in str(err.value)
    with pytest.raises(ConfigError, match=r"^data.vocab_size: .* up to 31999, .* data.vocab_size=31999 allows 0..31998.*"
                       r"older NullTokenizer\(31999\) ended documents with 31999"):  # fmt: skip
        data_mod.check_token_ids(prefix, NullTokenizer(31999))
    with pytest.raises(ConfigError, match=r"allows 0..999; set data.vocab_size to at least 32000 \(the [^)]*\)$"):
        data_mod.check_token_ids(prefix, NullTokenizer(1000))


def test_splits_megatron_would_loop_on_or_run_out_of_memory_over(tmp_path):
    prefix = str(tmp_path / "d")
    write_dataset(prefix, [np.arange(1000) % 250], 257)  # one document: the 2% valid share gets none
    with pytest.raises(ConfigError, match="the valid split of .* gets none of its 1 documents but Megatron's .* loops"):
        data_mod.check_splits(prefix, "98,2,0", [32, 0, 0], 128)
    data_mod.check_splits(prefix, "100,0,0", [32, 0, 0], 128)
    write_dataset(prefix, [np.arange(1000) % 250] * 100, 257)  # 100 documents of 1000 tokens: 98 train, 2 valid
    with pytest.raises(ConfigError, match=r"^train.eval_steps: the run asks for 10000000000 valid samples .* over the 2000"):
        data_mod.check_splits(prefix, "98,2,0", [32, 10**10, 0], 128)
    with pytest.raises(ConfigError, match=r"^train.steps: Megatron's dataset index of the 100000000 train samples"):
        data_mod.check_splits(prefix, "98,2,0", [10**8, 10, 0], 128, available_bytes=2**30)  # needs >= 1.1 GiB
    data_mod.check_splits(prefix, "98,2,0", [10**6, 10, 0], 128, available_bytes=2**30)


def test_prepare_data_script(tmp_path, local_tokenizer):
    directory, tok = local_tokenizer
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("def f(x):\n    return x + 1\n")
    lines = [{"text": "the quick brown fox"}, {"text": ""}, {"text": "jumps over\nthe lazy dog"}]
    (tmp_path / "in" / "b.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out" / "corpus"
    cmd = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--tokenizer", str(directory), "--out", str(out)]
    proc = subprocess.run([*cmd, str(tmp_path / "in")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eot = tok.token_to_id(EOT)
    texts = ["def f(x):\n    return x + 1\n", "the quick brown fox", "jumps over\nthe lazy dog"]
    want = [[*tok.encode(t).ids, eot] for t in texts]  # files in sorted order, the empty document skipped
    got = read_dataset(out)
    assert [g.tolist() for g in got] == want
    n = sum(map(len, want))
    assert f"3 documents, {n} tokens" in proc.stdout and f"vocabulary {tok.get_vocab_size()}" in proc.stdout
    assert f"largest id {max(map(max, want))} (uint16)" in proc.stdout
    assert f"data=indexed data.path={out} data.tokenizer={directory}" in proc.stdout



def test_prepare_data_refuses_bad_input_and_leaves_nothing(tmp_path, local_tokenizer, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "empty.txt").write_text("")
    base = ["--no-progress", "--tokenizer", str(local_tokenizer[0]), "--out", str(tmp_path / "x")]
    missing = str(tmp_path / "no.json")
    for extra, message in [
        ([str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON object with a string 'text' field (--json-key)"),
        ([str(tmp_path / "missing.txt")], "missing.txt: no such file or directory"),
        ([str(tmp_path / "empty.txt")], "no documents in"),
        (["--tokenizer", "null", str(tmp_path / "empty.txt")], "--tokenizer: null tokenizes no text"),
        (["--tokenizer", missing, str(tmp_path / "empty.txt")], f"--tokenizer: {missing} not found"),
    ]:
        assert script.main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
        assert not list(tmp_path.glob("x*"))


def test_own_text_recipe_prepares_the_data_and_trains_on_it(tmp_path, local_tokenizer):
    import os

    text = tmp_path / "text"
    text.mkdir()
    (text / "a.jsonl").write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 20}) for i in range(60)))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(TEXT=str(text), TOKENIZER=str(local_tokenizer[0]), DATA_PREFIX=str(tmp_path / "corpus"), PYTHON=sys.executable,
               GPUS="1", CHECK_SPEC="0", OMP_WAIT_POLICY="PASSIVE")  # fmt: skip
    run = tmp_path / "run"
    tiny = ["model=tiny", "model.num_layers=1", "model.seq_length=64", "model.attention=local", "backend=reference",
            "train.steps=3", "train.eval_interval=0", "logging.log_interval=1", "logging.progress=false",
            f"logging.dir={run}", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "pretrain_own_text.sh"), *tiny], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "60 documents" in proc.stdout and (tmp_path / "corpus.bin").stat().st_size > 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(losses(records)) == [1, 2, 3]


def test_a_32k_vocabulary_dataset_trains_with_the_null_tokenizer_and_stops_without(tmp_path):
    """Ids up to 31999 (the null tokenizer's end of document); a skewed unigram distribution, so that
    a few steps lower the loss from about ln(32000) = 10.4."""
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 32000) ** 1.2  # ids 0..31998; 31999 ends each document
    docs = [np.append(rng.choice(31999, size=rng.integers(50, 400), p=weights / weights.sum()), 31999) for _ in range(200)]
    write_dataset(tmp_path / "corpus", docs, 32000)
    common = ["data=indexed", f"data.path={tmp_path / 'corpus'}", "model.seq_length=64", "model.num_layers=1",
              "train.micro_batch_size=4", "train.steps=6", "logging.log_interval=1", "train.lr=1e-2"]  # fmt: skip
    proc, _ = train(tmp_path, *common, name="byte")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data.tokenizer: " in proc.stderr and "holds token ids up to 31999, but data.tokenizer=byte" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "byte" / "metrics.jsonl").exists()
    proc, records = train(tmp_path, *common, "data.tokenizer=null", "data.vocab_size=32000", name="null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from primus_fp8_plugin.config.resources import parameter_count

    from .hydra_compose import compose

    start = next(r for r in records if r.get("event") == "start")
    assert start["params"] == parameter_count(compose(*common), 32000)  # embedding and output layer: 32000 rows
    loss = losses(records)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert abs(loss[1] - np.log(32000)) < 0.5 and loss[6] < loss[1] - 1.0, loss
