"""Start-up checks of a run against the machine it starts on: the directories it will write, the data
files it will read, the backend it names, and whether one training step can fit in memory at all.

``config.validate`` checks values without touching anything; these run once the device is known,
before any data is built or weight allocated, and raise ``ConfigError`` naming the field.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .schema import TE_MODES, ConfigError

_INDEX_MAGIC = b"MMIDIDX\x00\x00"  # the first bytes of a Megatron indexed dataset's .idx file
GiB = 2**30


def check_paths(cfg: Any) -> None:
    """``logging.dir``, ``data.cache_dir`` and ``checkpoint.dir`` (if set) exist or can be made, and a
    file can be written in each (a real write: permissions, read-only mounts and files in the way all
    show); with ``data.source=indexed``, ``data.path`` names a readable ``.bin``/``.idx`` pair."""
    dirs = [("logging.dir", cfg.logging.dir), ("data.cache_dir", cfg.data.cache_dir)]
    if cfg.checkpoint.dir:
        dirs.append(("checkpoint.dir", cfg.checkpoint.dir))
    for name, directory in dirs:
        check_writable(name, Path(directory))
    if cfg.data.source == "indexed":
        check_indexed_prefix(str(cfg.data.path))


def check_writable(name: str, directory: Path) -> None:
    """Make ``directory`` (and its parents) and write and remove a file in it; ConfigError naming
    the field ``name`` if either fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_check_") as f:
            f.write(b"\0")
            f.flush()
    except OSError as err:
        raise ConfigError(f"{name}: cannot write to {directory} ({err.strerror or err}); choose a writable directory") from None


def check_indexed_prefix(prefix: str) -> None:
    """``<prefix>.bin`` and ``<prefix>.idx`` exist and are readable, the ``.idx`` starts with Megatron's
    index header and the ``.bin`` is not empty."""
    hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
    for suffix in (".bin", ".idx"):
        path = Path(prefix + suffix)
        if not path.is_file():
            raise ConfigError(f"data.path: {path} not found{hint}; data.source=indexed reads <prefix>.bin and <prefix>.idx")
        try:
            with path.open("rb") as f:
                head = f.read(len(_INDEX_MAGIC))
        except OSError as err:
            raise ConfigError(f"data.path: cannot read {path} ({err.strerror or err})") from None
        if suffix == ".bin" and not head:
            raise ConfigError(f"data.path: {path} is empty")
        if suffix == ".idx" and head != _INDEX_MAGIC:
            raise ConfigError(f"data.path: {path} is not a Megatron indexed-dataset index (bad header)")


def parameter_count(cfg: Any, vocab_size: int) -> int:
    """Parameters of the GPT that ``cfg.model`` describes (all ranks together): embedding and an
    untied output layer over ``vocab_size`` (padded) tokens, learned position embeddings, per layer
    QKV (grouped-query aware), projection, MLP (SwiGLU doubles fc1; MoE: per expert, plus the router),
    biases and two norms, and the final norm."""
    m = cfg.model
    h, f = m.hidden_size, m.ffn_hidden_size
    kv = (m.num_query_groups or m.num_attention_heads) * (h // m.num_attention_heads)
    fc1 = f * (2 if m.swiglu else 1)
    bias = bool(m.add_bias_linear)
    attention = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if bias else 0)
    mlp = h * fc1 + f * h + (fc1 + h if bias else 0)
    if m.num_experts:
        mlp = m.num_experts * mlp + m.num_experts * h  # experts + the router's [experts, hidden] weight
    norm = 2 * h if m.normalization == "LayerNorm" else h
    position = m.seq_length * h if m.position_embedding_type == "learned_absolute" else 0
    return m.num_layers * (attention + mlp + 2 * norm) + 2 * vocab_size * h + position + norm


def memory_lower_bound(cfg: Any, world_size: int, vocab_size: int) -> dict[str, int]:
    """Bytes per process that one training step needs at the least, by part: what certainly gets
    allocated, not what a step really uses (several times more), so that a run this refuses could
    not have fit. Parts: weights with fp32 gradients and Adam state (2 + 4 + 12 bytes a parameter;
    the 12 spread over data-parallel ranks with the distributed optimizer) without and with the
    position embeddings, the attention probabilities that Megatron's local attention keeps for the
    backward (``micro_batch x heads x seq^2`` a layer, the fp32 softmax output and its bf16 copy: 6
    bytes an entry; none for SDPA or TE's fused attention),
    one bf16 ``seq x micro_batch x hidden`` activation a layer, and the bf16 logits."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    shard = p.tp * p.pp
    dp = max(world_size // shard, 1)
    state_bytes = 2 + 4 + (12 / dp if p.use_distributed_optimizer else 12)
    position = m.seq_length * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0
    weights = parameter_count(cfg, vocab_size) - position
    layers = m.num_layers // p.pp
    b, s = t.micro_batch_size, m.seq_length
    local_attention = m.attention == "local" and cfg.fp8.mode not in TE_MODES
    heads = m.num_attention_heads // p.tp
    return {
        "weights and optimizer state": int(weights * state_bytes / shard),
        "position embeddings": int(position * state_bytes / shard),
        "attention probabilities": layers * b * heads * s * s * 6 if local_attention else 0,
        "activations": layers * b * s * m.hidden_size * 2 // (p.tp if p.sequence_parallel else 1),
        "logits": b * s * (vocab_size // p.tp) * 2,
    }


def available_memory(device) -> tuple[int, str]:
    """(bytes free, what it is) for ``device``: the GPU's free memory, or the host's available memory
    shared by the processes of this node."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"GPU {torch.cuda.get_device_name(device)}"
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return int(psutil.virtual_memory().available) // local, "the host" + (f" (shared by {local} processes)" if local > 1 else "")


def check_memory(cfg: Any, world_size: int, vocab_size: int, available: int, where: str = "the device") -> None:
    """ConfigError when ``memory_lower_bound`` exceeds ``available`` bytes, naming model.seq_length when
    the sequence-dependent parts dominate (else the model's size) and what to change."""
    parts = memory_lower_bound(cfg, world_size, vocab_size)
    need = sum(parts.values())
    if need <= available:
        return
    by_sequence = need - parts["weights and optimizer state"]
    detail = ", ".join(f"{k} {v / GiB:.3g}" for k, v in parts.items() if v)
    m, t = cfg.model, cfg.train
    head = f"a training step needs at least {need / GiB:.3g} GiB per process ({detail} GiB)"
    have = f"{where} has {available / GiB:.3g} GiB available"
    if by_sequence >= parts["weights and optimizer state"]:
        fix = "lower model.seq_length or train.micro_batch_size"
        if parts["attention probabilities"]:
            fix += ", or use model.attention=sdpa (no seq_length^2 attention probabilities)"
        raise ConfigError(
            f"model.seq_length: {head} with model.seq_length={m.seq_length} and "
            f"train.micro_batch_size={t.micro_batch_size}, but {have}; {fix}"
        )
    raise ConfigError(
        f"model: {head}, but {have}; use a smaller model, split it over more GPUs (parallel.tp, parallel.pp) "
        "or spread the optimizer state (parallel.use_distributed_optimizer with data parallelism)"
    )


def check_backend(cfg: Any, device) -> None:
    """A backend named explicitly (not ``auto``) can run on ``device`` (the registry's availability:
    a Triton backend on a CPU cannot, for one); ConfigError naming backend.name and the backends that can."""
    name = cfg.backend.name
    if name == "auto":
        return
    from ..backends import available_backends, backend_availability

    availability = backend_availability(name, device)
    if not availability:
        usable = [n for n, a in available_backends(device).items() if a]
        raise ConfigError(
            f"backend.name: {name!r} cannot run on {device} ({availability.reason}); use backend=auto or one of {usable}"
        )


def check_resources(cfg: Any, world_size: int, device, vocab_size: int) -> None:
    """Every start-up check of this module: the backend and memory first (they write nothing), then
    the paths."""
    check_backend(cfg, device)
    available, where = available_memory(device)
    check_memory(cfg, world_size, vocab_size, available, where)
    check_paths(cfg)
