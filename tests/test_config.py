"""Start-up validation of the trainer's configuration: every value the schema's types let through but
the run could not use stops it with a ConfigError naming the field (exit 2 through the trainer's main,
tests/test_train.py); the machine-dependent checks (writable directories, data files, memory)."""

from __future__ import annotations

import pytest

pytest.importorskip("hydra")

from primus_fp8_plugin.config.resources import check_memory, check_paths, memory_lower_bound  # noqa: E402
from primus_fp8_plugin.config.schema import ConfigError, composition_error_message, validate  # noqa: E402
from tests.hydra_compose import CONFIG_DIR, compose  # noqa: E402

GiB = 2**30


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.micro_batch_size=0"], "train.micro_batch_size: must be > 0"),
        (["train.micro_batch_size=-8"], "train.micro_batch_size: must be > 0"),
        (["train.global_batch_size=0"], "train.global_batch_size: must be > 0"),
        (["logging.log_interval=0"], "logging.log_interval: must be >= 1"),
        (["train.weight_decay=-0.1"], "train.weight_decay: must be >= 0"),
        (["train.lr_decay_style=exponential"], "train.lr_decay_style: 'exponential' is not one of"),
        (["train.lr_decay_style=WSD"], "train.lr_decay_style: 'WSD' is not one of"),
        (["model.num_query_groups=3"], "model.num_query_groups: 3 does not divide model.num_attention_heads (4)"),
        (["model.num_query_groups=0"], "model.num_query_groups: must be > 0"),
        (["data.split=abc"], "data.split: 'abc': give one to three non-negative numbers"),
        (["data.split='-1,2,3'"], "data.split: '-1,2,3': give one to three"),
        (["data.split='1,2,3,4'"], "data.split: '1,2,3,4': give one to three"),
        (["data.split='0,1,0'"], "data.split: '0,1,0': the train share must be > 0"),
        (["data.split='100,0,0'", "train.eval_interval=10"], "data.split: '100,0,0': the valid share is 0"),
        (["fp8.bf16_layers=[5]"], "fp8.bf16_layers: [5] out of range for model.num_layers=2"),
        (["fp8.bf16_layers=[0,-3]"], "fp8.bf16_layers: [-3] out of range"),
        (["+train.foo=1"], "train.foo: unknown key (train has steps, "),
        (["+train.stpes=1"], "train.stpes: unknown key; did you mean train.steps?"),
        (["+foo=1"], "foo: unknown key (the configuration has model, "),
        (["train.eval_steps=0"], "train.eval_steps: must be > 0 when train.eval_interval > 0"),
        (["train.seed=-1"], "train.seed: must be in [0, 2**32)"),
        (["train.clip_grad=-1"], "train.clip_grad: must be >= 0"),
        (["checkpoint.save_interval=-5"], "checkpoint.save_interval: must be >= 0"),
        (["model.num_experts=4", "model.moe_router_topk=5"], "model.moe_router_topk: must be in [1, model.num_experts=4]"),
        (["data=indexed"], "data.path: data.source=indexed needs"),
        # NaN and inf pass the schema's float type (lr=inf trained into NaN losses)
        (["train.lr=inf"], "train.lr: must be a finite number (got inf)"),
        (["train.lr=nan"], "train.lr: must be a finite number (got nan)"),
        (["train.min_lr=-inf"], "train.min_lr: must be a finite number (got -inf)"),
        (["train.clip_grad=inf"], "train.clip_grad: must be a finite number"),
        (["train.weight_decay=nan"], "train.weight_decay: must be a finite number"),
        (["model.init_method_std=inf"], "model.init_method_std: must be a finite number"),
        (["train.steps=10", "train.warmup_steps=10"], "train.warmup_steps: 10 must be in [0, train.steps=10); or leave it null"),
        (["train.global_batch_size=12"], "train.global_batch_size: 12 is not a multiple of train.micro_batch_size x "
         "data-parallel size = 8 x 1; set it to a multiple of 8 (or null: 8), or train.micro_batch_size to a divisor of 12"),
        (["parallel.tp=0"], "parallel.tp: tp and pp must be >= 1"),
        (["model.make_vocab_size_divisible_by=0"], "model.make_vocab_size_divisible_by: must be >= 1"),
        # the tokenizer's fields
        (["data=indexed", "data.path=/x", "data.tokenizer=null"], "data.vocab_size: data.tokenizer=null needs the vocabulary"),
        (["data=indexed", "data.path=/x", "data.tokenizer=null", "data.vocab_size=0"], "data.vocab_size: 0: must be in [1, "),
        (["data=indexed", "data.path=/x", "data.tokenizer=null", "data.vocab_size=100", "data.eod_id=100"],
         "data.eod_id: 100 is not an id of the vocabulary (0..99)"),
        (["data.vocab_size=32000"], "data.vocab_size: only data.tokenizer=null takes a vocabulary size (byte brings its own)"),
        (["data.tokenizer=gpt2", "data.vocab_size=32000"], "data.vocab_size: only data.tokenizer=null takes"),
        (["data.eod_id=3"], "data.eod_id: the byte tokenizer ends a document with 256"),
        (["data.tokenizer=gpt2", "data.eod_id=-1"], "data.eod_id: -1: must be >= 0"),
        (["data.tokenizer=null", "data.vocab_size=100"], "data.tokenizer: null tokenizes no text, and data.source=stdlib"),
        (["data.tokenizer=' '"], "data.tokenizer: give byte, null or a Hugging Face tokenizer"),
    ],
)
def test_values_the_run_cannot_use_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel.tp=2", "model.num_query_groups=1"], 2, "parallel.tp: must divide model.num_query_groups (1)"),
        (["parallel.tp=2", "model.ffn_hidden_size=1001"], 2, "parallel.tp: must divide model.ffn_hidden_size (1001)"),
        (["parallel=tp2_sp", "model.seq_length=127"], 2, "model.seq_length: must be a multiple of parallel.tp (2)"),
    ],
)
def test_tensor_parallel_divisibility(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose(*overrides), world_size)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["fp8.bf16_layers=[0,-1]", "model.num_query_groups=2", "train.lr_decay_style=linear"],
        ["train.lr_decay_style=constant", "train.lr_decay_style=inverse-square-root"],
        ["data.split='100,0,0'", "train.eval_interval=0"],
        ["data.split='99'", "train.eval_interval=0", "train.weight_decay=0"],
        ["data.split='0.9, 0.1'"],
        ["data=indexed", "data.path=/x", "data.tokenizer=null", "data.vocab_size=32000"],
        ["data=indexed", "data.path=/x", "data.tokenizer='null'", "data.vocab_size=32000", "data.eod_id=0"],
        ["data.tokenizer=gpt2", "data.eod_id=50256"],
        ["train.steps=1"],  # the default warmup composes with any number of steps
    ],
)
def test_values_that_work_pass(overrides):
    validate(compose(*overrides))


def test_a_value_of_the_wrong_type_names_the_key_and_the_type():
    from hydra.errors import HydraException

    with pytest.raises(HydraException) as err:
        compose("train.steps=abc")
    message = composition_error_message(err.value)
    assert "train.steps=abc" in message and "could not be converted to Integer" in message
    assert "full_key: train.steps" in message


def test_unwritable_directories_are_refused_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    ok = [f"logging.dir={tmp_path / 'log'}", f"data.cache_dir={tmp_path / 'data'}"]
    check_paths(compose(*ok, f"checkpoint.dir={tmp_path / 'ckpt'}"))
    assert (tmp_path / "ckpt").is_dir() and not list((tmp_path / "ckpt").iterdir())  # the probe file is gone
    for field in ("logging.dir", "data.cache_dir", "checkpoint.dir"):
        cfg = compose(*ok, f"{field}={blocker / 'sub'}")
        with pytest.raises(ConfigError, match=f"^{field}: cannot write to {blocker / 'sub'}"):
            check_paths(cfg)


def test_read_only_directory_is_refused(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    cfg = compose(f"logging.dir={ro}", f"data.cache_dir={tmp_path / 'data'}")
    with pytest.raises(ConfigError, match="logging.dir: cannot write to"):
        check_paths(cfg)


def test_indexed_data_that_is_not_there_is_refused(tmp_path):
    base = [f"logging.dir={tmp_path / 'log'}", f"data.cache_dir={tmp_path / 'data'}", "data=indexed"]
    with pytest.raises(ConfigError, match=f"data.path: {tmp_path / 'corpus'}.bin not found;"):
        check_paths(compose(*base, f"data.path={tmp_path / 'corpus'}"))
    (tmp_path / "corpus.bin").write_bytes(b"\1\2")
    with pytest.raises(ConfigError, match=r"corpus.bin.bin not found \(give the prefix, without .bin/.idx\)"):
        check_paths(compose(*base, f"data.path={tmp_path / 'corpus.bin'}"))
    with pytest.raises(ConfigError, match=f"data.path: {tmp_path / 'corpus'}.idx not found"):
        check_paths(compose(*base, f"data.path={tmp_path / 'corpus'}"))
    (tmp_path / "corpus.idx").write_bytes(b"not an index")
    with pytest.raises(ConfigError, match="is not a Megatron indexed-dataset index"):
        check_paths(compose(*base, f"data.path={tmp_path / 'corpus'}"))
    (tmp_path / "corpus.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\0" * 16)
    check_paths(compose(*base, f"data.path={tmp_path / 'corpus'}"))


def test_memory_check_refuses_what_cannot_fit_and_names_the_field():
    tiny = compose()
    check_memory(tiny, 1, 512, available=1 * GiB)  # the default fits in far less
    with pytest.raises(ConfigError) as err:
        check_memory(compose("model.seq_length=1000000"), 1, 512, available=16 * GiB, where="the host")
    msg = str(err.value)
    assert msg.startswith("model.seq_length: a training step needs at least") and "model.seq_length=1000000" in msg
    assert "the host has 16 GiB available" in msg and "model.attention=sdpa" in msg
    # SDPA keeps no seq^2 probabilities: 64k tokens fit in the bound with it, not without
    long = ["model.seq_length=65536", "model.position_embedding_type=rope", "train.micro_batch_size=1"]
    check_memory(compose(*long, "model.attention=sdpa"), 1, 512, available=16 * GiB)
    with pytest.raises(ConfigError, match="model.seq_length: "):
        check_memory(compose(*long), 1, 512, available=16 * GiB)
    llama = compose("model=llama3_8b", "model.attention=sdpa", "train.micro_batch_size=1")
    with pytest.raises(ConfigError, match=r"^model: a training step needs at least 139 GiB .*\(parallel.tp, parallel.pp\)"):
        check_memory(llama, 1, 128256, available=64 * GiB)  # 8.03e9 parameters x 18 bytes: 135 GiB


def test_parameter_count_of_llama3_8b_is_the_published_one():
    from primus_fp8_plugin.config.resources import parameter_count

    assert parameter_count(compose("model=llama3_8b"), 128256) == 8_030_261_248  # Meta-Llama-3-8B


def test_memory_lower_bound_parts():
    cfg = compose("model.seq_length=512", "train.micro_batch_size=2")
    parts = memory_lower_bound(cfg, 1, 512)
    L, b, s, h, heads = 2, 2, 512, 256, 4
    assert parts["attention probabilities"] == L * b * heads * s * s * 6
    assert parts["activations"] == L * b * s * h * 2 and parts["logits"] == b * s * 512 * 2
    assert parts["position embeddings"] == s * h * 18
    # the distributed optimizer spreads the 12 bytes of fp32 master weights and Adam moments over DP ranks
    dp4 = memory_lower_bound(compose("parallel=dp"), 4, 512)["weights and optimizer state"]
    dp1 = memory_lower_bound(compose(), 1, 512)["weights and optimizer state"]
    assert dp4 == pytest.approx(dp1 * (6 + 3) / 18, rel=1e-6)


def test_derived_values_compose_with_any_steps_and_world_size():
    """Null train.warmup_steps is train.steps // 10 (20 for the default 200 steps, 200 for the
    convergence preset's 2000); null train.global_batch_size is micro_batch_size x data-parallel size."""
    from primus_fp8_plugin.config.schema import Config, ParallelConfig, TrainConfig, resolve

    default, convergence = compose(), compose("train=convergence")
    assert default.train.warmup_steps is None and default.train.global_batch_size is None
    assert resolve(default).train.warmup_steps == 20 and resolve(convergence).train.warmup_steps == 200
    assert resolve(default) is not default and default.train.warmup_steps is None  # a copy; the input stays
    assert resolve(convergence, 2).train.global_batch_size == 32  # an explicit value stays
    for steps, warmup in [(1, 0), (9, 0), (10, 1), (20, 2)]:
        assert resolve(Config(train=TrainConfig(steps=steps))).train.warmup_steps == warmup
        validate(Config(train=TrainConfig(steps=steps)))
    assert resolve(Config(train=TrainConfig(warmup_steps=5))).train.warmup_steps == 5
    for world, tp, gbs in [(1, 1, 8), (2, 1, 16), (8, 1, 64), (8, 2, 32)]:
        cfg = Config(parallel=ParallelConfig(tp=tp, use_distributed_optimizer=True))
        assert resolve(cfg, world).train.global_batch_size == gbs
        validate(cfg, world)
    cfg = Config(train=TrainConfig(global_batch_size=8, warmup_steps=1))
    assert resolve(cfg, 2) is cfg  # nothing to derive: the same object


@pytest.mark.parametrize("option", sorted(f"{p.parent.name}={p.stem}" for p in CONFIG_DIR.glob("*/*.yaml")))
def test_every_preset_is_valid_with_the_default_batches(option):
    """Each option of each config group, with every other group at its default, validates on 1, 2, 4
    and 8 processes (data parallel where nothing else splits the model); so the configs' own keys are
    the schema's too. Exceptions: parallel=tp2_sp needs 2 processes; train=convergence fixes its
    global batch (32 sequences in micro-batches of 16: the experiment's definition), so beyond 2
    data-parallel ranks it says what to change. Only a missing Transformer Engine may stop an fp8 option."""
    cfg = compose(option, "data.path=/x") if option == "data=indexed" else compose(option)
    for world_size in (1, 2, 4, 8):
        if option == "parallel=tp2_sp" and world_size == 1:
            continue
        if option == "train=convergence" and world_size > 2:
            with pytest.raises(ConfigError, match="set it to a multiple of .* or train.micro_batch_size to a divisor of"):
                validate(cfg, world_size)
            continue
        try:
            validate(cfg, world_size)
        except ConfigError as err:
            assert option.startswith("fp8=te") and "needs Transformer Engine" in str(err), err
