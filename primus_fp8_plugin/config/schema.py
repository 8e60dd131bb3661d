"""Structured (typed) configuration of a training run, validated at start-up.

Hydra composes ``configs/`` (one folder per group below: model, fp8, backend, parallel, data, train,
checkpoint, logging) into these dataclasses; a wrong type fails at composition and a wrong value
fails in ``validate`` with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..backends.names import backend_names

FP8_MODES = ("bf16", "blockwise", "te_blockwise", "te_bf16", "te_spec_blockwise")
TE_MODES = ("te_blockwise", "te_bf16", "te_spec_blockwise")  # built from TE's layer spec
PLUGIN_LINEAR_MODES = ("blockwise", "te_spec_blockwise")  # fp8.mode values that run the plugin's linears
BACKENDS = ("auto", *backend_names())  # the registry's names (backends/names.py)
# Megatron's OptimizerParamScheduler styles that need no parameters beyond train.* (WSD needs its own)
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
# What makes a run itself: a resume (or checkpoint.load) that changes one of these stops the run unless
# checkpoint.allow_changes names it (a group covers its fields). backend.resolved: the backend "auto"
# resolved to, compared where the plugin's linears run; schedule fields (train.steps, lr, ...) may change.
RUN_IDENTITY = (
    "model", "fp8", "backend.resolved", "data", "train.seed",
    "parallel.tp", "parallel.pp", "parallel.sequence_parallel", "parallel.use_distributed_optimizer",
)  # fmt: skip
# fields inside RUN_IDENTITY's groups that change how a run holds its state, not what it computes: a resume or
# checkpoint.load may change them (fp8.params: the same bits either way; its checkpoints are the BF16-weight run's)
NOT_IDENTITY = ("fp8.params",)
# "train,valid,test" shares: one to three non-negative decimals, comma-separated
_SPLIT = re.compile(r"^\s*\d+(?:\.\d*)?(?:\s*,\s*\d+(?:\.\d*)?){0,2}\s*$")


@dataclass
class ModelConfig:
    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 256
    ffn_hidden_size: int = 1024
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # GQA groups; None = multi-head attention
    seq_length: int = 128
    normalization: str = "LayerNorm"  # or RMSNorm
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"  # or rope
    # core attention of the bf16/blockwise specs: local (Megatron's unfused) or sdpa (PyTorch's fused
    # kernels, TE-free); the te_* modes always use TE's fused attention
    attention: str = "local"
    add_bias_linear: bool = True
    num_experts: int | None = None
    moe_router_topk: int = 2
    # MoE experts: true = grouped (one grouped FP8 GEMM per pass for all local experts: Megatron's TEGroupedMLP
    # with the plugin's grouped linears, or TE's in the te_* modes); false = SequentialMLP (a GEMM per expert)
    moe_grouped_gemm: bool = False
    init_method_std: float = 0.02
    # the embedding's rows: the vocabulary rounded up to a multiple of this x parallel.tp, as Megatron-LM
    # pads (--make-vocab-size-divisible-by); runs with different TP sizes build the same embedding (and
    # start from the same weights) only where the rounding agrees
    make_vocab_size_divisible_by: int = 128


@dataclass
class Fp8Config:
    # bf16 | blockwise (this plugin) | te_blockwise (TE Float8BlockScaling) | te_bf16 (TE spec, BF16) |
    # te_spec_blockwise (TE spec with this plugin's linears swapped in, TE's norms and attention kept:
    # differs from te_blockwise only in the linears)
    mode: str = "blockwise"
    fp8_format: str = "E4M3"  # or HYBRID
    pow2_scales: bool = True
    bf16_layers: list[int] = field(default_factory=list)  # layer indices kept in BF16 (negative ok)
    # FP8 primary weights (the plugin's linears, fp8_params.py): between optimizer steps each linear's weight is held
    # as its 128x128 FP8 W only (no BF16 copy, W^T made per dgrad); the same losses bit for bit as false
    params: bool = False


@dataclass
class BackendConfig:
    name: str = "auto"


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    # Initialise the full weights on the CPU, then shard: runs with different TP sizes start from the
    # same weights (for TP-equivalence checks; with the same padded vocabulary: model.make_vocab_size_divisible_by).
    # Off on a GPU by default: each rank initialises its shard.
    cpu_initialization: bool = False


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib: Python's own source files, byte tokens; indexed: a Megatron prefix
    path: str | None = None  # for source=indexed: the prefix of a .bin/.idx pair
    cache_dir: str = "outputs/data"
    max_bytes: int = 16_000_000  # how much stdlib source to tokenize
    split: str = "98,2,0"
    # byte (UTF-8 bytes, vocabulary 257) | null (Megatron's NullTokenizer: the ids are the data; needs
    # vocab_size) | a Hugging Face tokenizer: a tokenizer.json, a directory holding one, or a hub name
    tokenizer: str | None = "byte"  # null on the command line is YAML's null: the same as the string "null"
    vocab_size: int | None = None  # data.tokenizer=null only: the vocabulary (ids 0..vocab_size-1)
    eod_id: int | None = None  # the end-of-document id; null: the tokenizer's own (null: vocab_size - 1)


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    global_batch_size: int | None = None  # null: micro_batch_size x data-parallel size (Megatron's default)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int | None = None  # null: train.steps // 10
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    eval_interval: int = 100
    eval_steps: int = 4
    # Megatron-core's per-layer CUDA graphs (TransformerConfig.cuda_graph_impl="local"): each
    # transformer layer's forward and backward replay as graphs after cuda_graph_warmup_steps, which
    # removes the per-kernel host cost (docs/PERFORMANCE.md). GPU only; run so far in training without
    # evaluation, checkpoints or TP > 1 (docs/INTEGRATION.md).
    cuda_graph: bool = False
    cuda_graph_warmup_steps: int = 3


@dataclass
class CheckpointConfig:
    # where this run saves its checkpoints and resumes from (checkpoint=periodic: <logging.dir>/checkpoints,
    # inside the run's own output directory); null: no checkpoints
    dir: str | None = None
    # start from another run's checkpoint (Megatron's --load): its checkpoint.dir (latest.txt) or one of its
    # iter_* directories; used only while checkpoint.dir holds no checkpoint of this run's own
    load: str | None = None
    save_interval: int = 0  # 0: only at the end (when dir is set)
    keep_latest: int = 0  # after each save keep the newest N checkpoints; 0 keeps all
    resume: bool = True  # false: start from fresh weights (a checkpoint.dir with checkpoints is then refused)
    # check every file of the checkpoint against its manifest (size, sha256) before loading it;
    # false loads a checkpoint without a manifest (or skips hashing a very large one)
    verify: bool = True
    # identity fields (RUN_IDENTITY: a group such as fp8, or one field such as parallel.tp) that a resume
    # may change; any other difference from the checkpoint's run stops the run
    allow_changes: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    dir: str = "outputs/run"
    log_interval: int = 10
    progress: bool = True
    tensorboard_dir: str | None = None  # TensorBoard event files (Megatron's --tensorboard-dir; needs tensorboard)
    wandb_project: str | None = None  # Weights & Biases project (needs wandb; WANDB_MODE=offline works offline)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    backend: BackendConfig = field(default_factory=BackendConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    device: str = "auto"  # auto | cpu | cuda


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}")


def _check_keys(cfg: Any) -> None:
    """Refuse keys the schema does not have (Hydra's ``+group.key=value`` adds them unchecked)."""
    if not hasattr(cfg, "keys"):  # a Config instance has exactly the schema's fields
        return
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    for key in cfg.keys():
        if key not in sections:
            raise ConfigError(f"{key}: unknown key{_did_you_mean(key, sections)} (the configuration has {', '.join(sections)})")
        factory = sections[key]
        if factory is dataclasses.MISSING or not hasattr(cfg[key], "keys"):
            continue
        known = [f.name for f in dataclasses.fields(factory)]
        for sub in cfg[key].keys():
            if sub not in known:
                raise ConfigError(
                    f"{key}.{sub}: unknown key{_did_you_mean(sub, known, key + '.')} ({key} has {', '.join(known)})"
                )


def _did_you_mean(name: str, choices, prefix: str = "") -> str:
    import difflib

    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def data_parallel_size(cfg: Any, world_size: int) -> int:
    """The data-parallel size, ``world_size // (tp x pp)``: at least 1, also for values of tp and pp
    that ``validate`` refuses."""
    return max(world_size // max(cfg.parallel.tp * cfg.parallel.pp, 1), 1)


def resolve(cfg: Any, world_size: int = 1) -> Any:
    """``cfg`` with the values left null to be derived filled in: ``train.global_batch_size`` =
    ``train.micro_batch_size`` x the data-parallel size (Megatron's default), ``train.warmup_steps`` =
    ``train.steps // 10``. Returns ``cfg`` itself when none is null, else a copy (read-only where
    ``cfg`` is an OmegaConf config)."""
    t = cfg.train
    fill = {}
    if t.global_batch_size is None:
        fill["global_batch_size"] = t.micro_batch_size * data_parallel_size(cfg, world_size)
    if t.warmup_steps is None:
        fill["warmup_steps"] = t.steps // 10
    if not fill:
        return cfg
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **fill))
    import copy

    from omegaconf import OmegaConf

    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    for key, value in fill.items():
        out.train[key] = value
    OmegaConf.set_readonly(out, True)
    return out


def _check_finite(cfg: Any) -> None:
    """Every float of the configuration is a number (NaN and inf pass the schema's type check)."""
    for section in dataclasses.fields(Config):
        if section.default_factory is dataclasses.MISSING:
            continue
        for f in dataclasses.fields(section.default_factory):
            if f.type not in ("float", float):  # (read no other field: some are interpolations resolved later)
                continue
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name}: must be a finite number (got {value})")


def validate(cfg: Any, world_size: int = 1) -> None:
    """Check keys and values (types were checked by the schema), the derived ones (``resolve``)
    included. Raises ConfigError naming the field.

    Pure: reads nothing but ``cfg``. What depends on the machine (writable directories, the data
    files, the tokenizer, the backend, memory) is checked by ``config.resources`` once the device is
    known."""
    _check_keys(cfg)
    _check_finite(cfg)
    _require(cfg.train.steps > 0, "train.steps", "must be > 0")
    cfg = resolve(cfg, world_size)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _require(cfg.fp8.mode in FP8_MODES, "fp8.mode", f"{cfg.fp8.mode!r} is not one of {FP8_MODES}")
    _require(cfg.fp8.fp8_format in ("E4M3", "HYBRID"), "fp8.fp8_format", f"{cfg.fp8.fp8_format!r}: use E4M3 or HYBRID")
    _require(cfg.backend.name in BACKENDS, "backend.name", f"{cfg.backend.name!r} is not one of {BACKENDS}")
    _require(cfg.device in ("auto", "cpu", "cuda"), "device", f"{cfg.device!r}: use auto, cpu or cuda")
    _require(m.normalization in ("LayerNorm", "RMSNorm"), "model.normalization", f"{m.normalization!r}")
    _require(m.attention in ("local", "sdpa"), "model.attention", f"{m.attention!r} is not one of local, sdpa")
    _require(
        m.position_embedding_type in ("learned_absolute", "rope"),
        "model.position_embedding_type",
        f"{m.position_embedding_type!r}",
    )
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length"):
        _require(getattr(m, name) > 0, f"model.{name}", "must be > 0")
    _require(not m.moe_grouped_gemm or bool(m.num_experts), "model.moe_grouped_gemm", "needs model.num_experts (an MoE model)")
    _require(m.hidden_size % m.num_attention_heads == 0, "model.hidden_size", "must be divisible by model.num_attention_heads")
    _require(m.init_method_std > 0, "model.init_method_std", "must be > 0")
    _require(m.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by", "must be >= 1")
    if m.num_query_groups is not None:
        _require(m.num_query_groups > 0, "model.num_query_groups", "must be > 0 (or null for multi-head attention)")
        _require(m.num_attention_heads % m.num_query_groups == 0, "model.num_query_groups",
                 f"{m.num_query_groups} does not divide model.num_attention_heads ({m.num_attention_heads})")  # fmt: skip
    if m.num_experts is not None:
        _require(m.num_experts > 0, "model.num_experts", "must be > 0 (or null for a dense model)")
        _require(
            1 <= m.moe_router_topk <= m.num_experts, "model.moe_router_topk", f"must be in [1, model.num_experts={m.num_experts}]"
        )
    _require(p.tp >= 1 and p.pp >= 1, "parallel.tp", "tp and pp must be >= 1")
    _require(world_size % (p.tp * p.pp) == 0, "parallel.tp", f"tp*pp = {p.tp * p.pp} does not divide the world size {world_size}")
    _require(m.num_attention_heads % p.tp == 0, "parallel.tp", f"must divide model.num_attention_heads ({m.num_attention_heads})")
    groups = m.num_query_groups or m.num_attention_heads
    _require(groups % p.tp == 0, "parallel.tp", f"must divide model.num_query_groups ({groups})")
    _require(m.ffn_hidden_size % p.tp == 0, "parallel.tp", f"must divide model.ffn_hidden_size ({m.ffn_hidden_size})")
    _require(m.num_layers % p.pp == 0, "parallel.pp", f"must divide model.num_layers ({m.num_layers})")
    _require(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", "needs parallel.tp > 1")
    _require(not p.sequence_parallel or m.seq_length % p.tp == 0, "model.seq_length",
             f"must be a multiple of parallel.tp ({p.tp}) with sequence parallelism")  # fmt: skip
    _require(not cfg.fp8.params or cfg.fp8.mode in PLUGIN_LINEAR_MODES, "fp8.params",
             f"FP8 primary weights are the plugin's linears' (fp8.mode {' or '.join(PLUGIN_LINEAR_MODES)}), not "
             f"fp8.mode={cfg.fp8.mode}'s")  # fmt: skip
    _require(not (cfg.fp8.params and t.cuda_graph), "fp8.params",
             "FP8 primary weights are re-made every step in new buffers, which a CUDA graph would not see: "
             "use train.cuda_graph=false with fp8.params=true")  # fmt: skip
    bad = [i for i in cfg.fp8.bf16_layers if not -m.num_layers <= i < m.num_layers]
    _require(not bad, "fp8.bf16_layers", f"{bad} out of range for model.num_layers={m.num_layers} "
             f"(use 0..{m.num_layers - 1}, or -1..-{m.num_layers} counting from the last layer)")  # fmt: skip
    dp = data_parallel_size(cfg, world_size)
    _require(t.micro_batch_size > 0, "train.micro_batch_size", "must be > 0")
    _require(t.global_batch_size > 0, "train.global_batch_size", "must be > 0")
    step = t.micro_batch_size * dp
    if t.global_batch_size % step:
        per_rank = t.global_batch_size // dp
        divisors = f", or train.micro_batch_size to a divisor of {per_rank}" if t.global_batch_size % dp == 0 else ""
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not a multiple of train.micro_batch_size x data-parallel "
            f"size = {t.micro_batch_size} x {dp}; set it to a multiple of {step} (or null: {step}){divisors}"
        )
    _require(t.lr >= 0, "train.lr", "must be >= 0")
    _require(0 <= t.min_lr <= t.lr, "train.min_lr", "must be in [0, train.lr]")
    _require(0 <= t.warmup_steps < t.steps, "train.warmup_steps",
             f"{t.warmup_steps} must be in [0, train.steps={t.steps}); or leave it null (train.steps // 10)")  # fmt: skip
    _require(t.lr_decay_style in LR_DECAY_STYLES, "train.lr_decay_style", f"{t.lr_decay_style!r} is not one of {LR_DECAY_STYLES}")
    _require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0 (got {t.weight_decay})")
    _require(t.clip_grad >= 0, "train.clip_grad", "must be >= 0 (0: no clipping)")
    _require(0 <= t.seed < 2**32, "train.seed", "must be in [0, 2**32)")
    _require(t.eval_interval >= 0, "train.eval_interval", "must be >= 0 (0: no evaluation)")
    _require(t.eval_interval == 0 or t.eval_steps > 0, "train.eval_steps", "must be > 0 when train.eval_interval > 0")
    _require(not t.cuda_graph or cfg.device != "cpu", "train.cuda_graph", "CUDA graphs need a GPU (device=cpu was set)")
    _require(t.cuda_graph_warmup_steps >= 1, "train.cuda_graph_warmup_steps", "must be >= 1")
    _require(cfg.checkpoint.save_interval >= 0, "checkpoint.save_interval", "must be >= 0 (0: save only at the end)")
    _require(cfg.checkpoint.keep_latest >= 0, "checkpoint.keep_latest", "must be >= 0 (0: keep every checkpoint)")
    for entry in cfg.checkpoint.allow_changes:
        _require(is_identity_entry(str(entry)), "checkpoint.allow_changes",
                 f"{entry!r} is not a field of the run's identity; name groups or fields of: {', '.join(RUN_IDENTITY)} "
                 "(schedule fields such as train.lr may change anyway)")  # fmt: skip
    _require(cfg.logging.log_interval >= 1, "logging.log_interval", "must be >= 1 (log every N steps)")
    _require(cfg.data.source in ("stdlib", "indexed"), "data.source", f"{cfg.data.source!r}: use stdlib or indexed")
    _require(cfg.data.source != "indexed" or bool(cfg.data.path), "data.path", "data.source=indexed needs a .bin/.idx prefix")
    _require(cfg.data.max_bytes > 0, "data.max_bytes", "must be > 0")
    check_tokenizer_fields(cfg.data.tokenizer, cfg.data.vocab_size, cfg.data.eod_id)
    _require(not (cfg.data.source == "stdlib" and tokenizer_name(cfg.data.tokenizer) == "null"), "data.tokenizer",
             "null tokenizes no text, and data.source=stdlib tokenizes Python's sources: use byte or a Hugging Face "
             "tokenizer there, or data=indexed data.path=PREFIX for data made with another tokenizer")  # fmt: skip
    _check_split(cfg.data.split, t.eval_interval)
    if cfg.fp8.mode in TE_MODES:  # built from TE's layer spec: refuse what it would silently ignore
        why = "TE's spec brings its own fused attention"
        _require(m.attention == "local", "model.attention", f"{m.attention!r} does not apply to fp8.mode={cfg.fp8.mode} ({why})")
        _require(not list(cfg.fp8.bf16_layers), "fp8.bf16_layers", f"is not supported with fp8.mode={cfg.fp8.mode}")
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as err:
            raise ConfigError(f"fp8.mode: {cfg.fp8.mode} needs Transformer Engine ({err})") from None


def tokenizer_name(tokenizer: str | None) -> str:
    """``data.tokenizer`` as a name: YAML's null (``data.tokenizer=null``) is the null tokenizer."""
    return "null" if tokenizer is None else str(tokenizer)


def check_tokenizer_fields(tokenizer: str | None, vocab_size: int | None, eod_id: int | None) -> None:
    """``data.tokenizer`` with ``data.vocab_size`` and ``data.eod_id``, without loading anything (a
    Hugging Face tokenizer is loaded, and the ids checked against it, by ``training.tokenizer``)."""
    name = tokenizer_name(tokenizer)
    _require(bool(name.strip()), "data.tokenizer", "give byte, null or a Hugging Face tokenizer (a name or a path)")
    if name == "null":
        _require(vocab_size is not None, "data.vocab_size", "data.tokenizer=null needs the vocabulary size: data.vocab_size=N")
        _require(0 < vocab_size < 2**31, "data.vocab_size", f"{vocab_size}: must be in [1, 2**31)")
        _require(eod_id is None or 0 <= eod_id < vocab_size, "data.eod_id",
                 f"{eod_id} is not an id of the vocabulary (0..{vocab_size - 1})")  # fmt: skip
        return
    _require(vocab_size is None, "data.vocab_size",
             f"only data.tokenizer=null takes a vocabulary size ({name} brings its own); remove it")  # fmt: skip
    if name == "byte":
        _require(eod_id is None, "data.eod_id", "the byte tokenizer ends a document with 256; remove data.eod_id")
    _require(eod_id is None or eod_id >= 0, "data.eod_id", f"{eod_id}: must be >= 0")


def is_identity_entry(entry: str) -> bool:
    """Whether ``entry`` names identity fields: one of ``RUN_IDENTITY``, a group above some (``parallel``,
    ``backend``), or a field of an identity group (``fp8.mode``, ``model.attention``)."""
    if entry in NOT_IDENTITY:
        return False
    if any(entry == f or f.startswith(entry + ".") for f in RUN_IDENTITY):
        return True
    group, _, name = entry.partition(".")
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    return group in RUN_IDENTITY and "." not in name and name in {f.name for f in dataclasses.fields(sections[group]())}


def _check_split(split: str, eval_interval: int) -> None:
    """``data.split`` as Megatron's builder reads it ("train,valid,test" weights, missing ones 0)."""
    form = "give one to three non-negative numbers, e.g. '98,2,0' (train, valid, test)"
    _require(bool(_SPLIT.match(str(split))), "data.split", f"{split!r}: {form}")
    shares = [float(x) for x in str(split).split(",")] + [0.0, 0.0]
    _require(shares[0] > 0, "data.split", f"{split!r}: the train share must be > 0")
    _require(eval_interval == 0 or shares[1] > 0, "data.split",
             f"{split!r}: the valid share is 0 but train.eval_interval={eval_interval} evaluates; give it a share "
             "or set train.eval_interval=0")  # fmt: skip


def composition_error_message(err: BaseException) -> str:
    """The message of a Hydra/OmegaConf composition error with its causes (the key, the value and
    the type the schema expects, e.g. ``train.steps=abc``), one line each, without repeats."""
    lines: list[str] = []
    while err is not None:
        for line in str(err).splitlines():
            if line.strip() and line.strip() not in (x.strip() for x in lines):
                lines.append(line)
        err = err.__cause__ if err.__cause__ is not None else (None if err.__suppress_context__ else err.__context__)
    return "\n  ".join(lines)
