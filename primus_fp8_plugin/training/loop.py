"""The training loop: Megatron's DDP, optimizer, LR schedule and forward-backward schedule, with
metrics (``metrics.py``), evaluation and exact save/resume through distributed checkpoints
(``checkpoint.py``), in directories the run holds locked (``lock.py``)."""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..config import validate
from ..config.resources import check_resources
from ..config.schema import PLUGIN_LINEAR_MODES, ConfigError, resolve
from ..fp8_params import param_bytes
from ..weight_cache import mark_weights_changed
from . import data as data_mod
from . import flops
from .checkpoint import RunInfo, config_dict, load_checkpoint, save_checkpoint, start_point
from .collective import rank0_decides
from .lock import DirectoryLock, DirectoryLockedError
from .metrics import METRICS_FILE, Metrics, claim_metrics_file, open_sinks
from .model import build_model, padded_vocab, transformer_config
from .tokenizer import run_tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(cfg) -> tuple[torch.device, contextlib.ExitStack]:
    """Device, process group (torchrun's environment, or a single process) and Megatron's groups."""
    from megatron.core import parallel_state, tensor_parallel

    stack = contextlib.ExitStack()
    want = cfg.device
    on_cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    validate(cfg, world)
    if cfg.train.cuda_graph and not on_cuda:
        raise ConfigError("train.cuda_graph: CUDA graphs need a GPU, and this run is on the CPU (no CUDA device visible)")
    if on_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        from ..megatron.cpu import CudaAsCpu, install_cpu_standins

        install_cpu_standins()
        stack.enter_context(CudaAsCpu())  # Megatron's optimizer hard-codes CUDA buffers
        device = torch.device("cpu")
    # before any data is built or weight allocated: the tokenizer, the backend, memory for one step, writable
    # directories, data files
    vocab = padded_vocab(run_tokenizer(cfg).vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
    check_resources(cfg, world, device, vocab)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl" if on_cuda else "gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.parallel.tp, pipeline_model_parallel_size=cfg.parallel.pp
    )
    seed = cfg.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if on_cuda:
        # Megatron's CUDA graphs need an RNG tracker whose states can live in a graph
        tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=bool(cfg.train.cuda_graph))
    stack.callback(parallel_state.destroy_model_parallel)
    return device, stack


def agree_on_run(cfg):
    """The configuration rank 0 resolved (its output directory, checkpoint directory, ...), read-only,
    on every rank: interpolations such as Hydra's output directory resolve per process."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.create(rank0_decides(lambda: config_dict(cfg)))
    OmegaConf.set_readonly(resolved, True)
    return resolved


def lock_run_dirs(cfg, stack: contextlib.ExitStack) -> None:
    """Lock ``logging.dir`` and ``checkpoint.dir`` for this run (rank 0; released when ``stack``
    closes). ConfigError on every rank when another live run holds one of them."""

    def take() -> None:
        wanted = [("logging.dir", cfg.logging.dir)]
        if cfg.checkpoint.dir and Path(cfg.checkpoint.dir).resolve() != Path(cfg.logging.dir).resolve():
            wanted.append(("checkpoint.dir", cfg.checkpoint.dir))
        for what, directory in wanted:
            try:
                lock = DirectoryLock.acquire(Path(directory), what, run_dir=str(cfg.logging.dir))
            except DirectoryLockedError as err:
                raise ConfigError(str(err)) from None
            stack.callback(lock.release)
            if lock.took_over:
                gone = lock.took_over.get("pid")
                print(f"note: {what}: took over the lock of a run that is no longer running (pid {gone})", flush=True)

    rank0_decides(take)


def resolved_backend(cfg, device) -> str | None:
    """The backend the plugin's linears run on (``auto`` resolved for ``device``); None when the fp8
    mode runs none of them."""
    if cfg.fp8.mode not in PLUGIN_LINEAR_MODES:
        return None
    if cfg.backend.name != "auto":
        return cfg.backend.name
    from ..backends import get_backend

    return get_backend("auto", device).name


def fp8_cache_bytes(model) -> int | None:
    """Bytes the plugin's FP8 weight caches hold in this process (the quantized W and W^T with their
    scales; W only for FP8 primary weights); None for Transformer Engine's FP8 layers, whose caches are TE's."""
    layers = [m for m in model.modules() if hasattr(m, "weight_cache_nbytes")]
    if not layers and any(type(m).__module__.startswith("transformer_engine") for m in model.modules()):
        return None
    return sum(m.weight_cache_nbytes for m in layers)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def _forward_step():
    """Megatron's ``forward_step_func``. The loss it returns is the micro-batch's mean token
    cross-entropy, which Megatron's schedule divides **in place** by the number of micro-batches for
    the backward pass; what is reported (``"lm loss"``) is a separate fp32 tensor
    ``[sum of token losses, token count]`` that the loop sums over micro-batches and data-parallel
    ranks (``_batch_mean``)."""

    def step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].float()

        def loss_func(per_token):
            total = (per_token.float() * mask).sum()
            count = mask.sum()
            loss = total / count.clamp_min(1.0)
            return loss, {"lm loss": torch.stack([total.detach(), count])}  # a new tensor

        return output, loss_func

    return step


def _batch_mean(reports: list[dict]) -> float:
    """Mean token loss over all micro-batches of all data-parallel ranks, from the loss function's
    ``[sum, count]`` reports (empty off the last pipeline stage: NaN)."""
    from megatron.core import parallel_state

    if not reports:
        return float("nan")
    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1].clamp_min(1.0))


def build_run_datasets(cfg):
    """(train, valid) GPTDatasets of a run (collective: rank 0 writes the stdlib corpus once, everyone
    reads it; every id of the data must be one of the tokenizer's). Training global batch ``k`` is
    train samples ``[k*G, (k+1)*G)``; every evaluation reads valid samples ``[0, train.eval_steps * G)``
    (``G = train.global_batch_size``)."""
    t = cfg.train
    tokenizer = run_tokenizer(cfg)
    if cfg.data.source == "stdlib":
        if dist.get_rank() == 0:
            data_mod.build_stdlib_corpus(cfg.data.cache_dir, cfg.data.max_bytes, tokenizer=tokenizer)
        dist.barrier()
        prefix = data_mod.build_stdlib_corpus(cfg.data.cache_dir, cfg.data.max_bytes, log=lambda *_: None, tokenizer=tokenizer)
    else:
        prefix = cfg.data.path
    data_mod.check_token_ids(prefix, tokenizer, cfg.data.cache_dir)
    n_evals = t.steps // t.eval_interval + 1 if t.eval_interval else 0  # no validation samples without
    sizes = [t.steps * t.global_batch_size, n_evals * t.eval_steps * t.global_batch_size, 0]
    train_ds, valid_ds, _ = data_mod.build_datasets(
        prefix, cfg.model.seq_length, t.seed, cfg.data.split, sizes, cfg.data.cache_dir, tokenizer
    )
    return train_ds, valid_ds


def build_ddp_and_optimizer(cfg, tconfig, model):
    """(Megatron's DDP around ``model``, Megatron's bf16 Adam over it) as a training run of ``cfg`` has them: gradients
    reduced in fp32, the distributed optimizer where ``parallel.use_distributed_optimizer``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t, dist_opt = cfg.train, cfg.parallel.use_distributed_optimizer
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    model = DistributedDataParallel(tconfig, ddp_config, model)
    # after each step's backward passes: the data-parallel gradient reduction, the tensor-parallel
    # all-reduce of sequence-parallel norm gradients, and the rest of Megatron's gradient fix-ups
    tconfig.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=0.9,
                        adam_beta2=0.95, bf16=True, clip_grad=t.clip_grad, use_distributed_optimizer=dist_opt),
        [model],
    )  # fmt: skip
    return model, optimizer


def run(cfg) -> dict:
    """Train as ``cfg`` says. Returns a summary (final loss, tokens/s, steps, paths)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..megatron.fp8_params import attach as attach_fp8_params

    device, stack = init_runtime(cfg)
    cfg = resolve(cfg, dist.get_world_size())  # the derived values (global batch, warmup) filled in
    with stack:
        cfg = agree_on_run(cfg)
        lock_run_dirs(cfg, stack)
        backend = resolved_backend(cfg, device)
        # a bad or another run's checkpoint, or another run's metrics file, stop the run here, before
        # data and model are built
        start_at = start_point(cfg, backend)
        metrics_path = Path(cfg.logging.dir) / METRICS_FILE
        dropped = rank0_decides(lambda: claim_metrics_file(metrics_path, start_at.run_id, start_at.iteration))
        if dist.get_rank() == 0:
            for line in start_at.repaired:
                print(f"note: checkpoint.dir: {line}", flush=True)
        sinks: list = []  # TensorBoard, W&B: opened on rank 0, a missing package stopping every rank
        rank0_decides(lambda: sinks.extend(open_sinks(cfg, start_at.run_id, config_dict(cfg))))
        run_info = RunInfo(start_at.run_id, backend, dist.get_world_size())
        rank = dist.get_rank()
        dp = parallel_state.get_data_parallel_world_size()
        t = cfg.train
        n_micro = t.global_batch_size // (t.micro_batch_size * dp)

        train_ds, valid_ds = build_run_datasets(cfg)

        tconfig = transformer_config(cfg, device.type == "cuda")
        vocab_size = run_tokenizer(cfg).vocab_size
        model, optimizer = build_ddp_and_optimizer(cfg, tconfig, build_model(cfg, tconfig, vocab_size, device))
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.warmup_steps,
            lr_decay_steps=t.steps, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=t.steps, wd_incr_style="constant",
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,  # a resume takes this schedule
        )  # fmt: skip
        resumed = load_checkpoint(cfg, model, optimizer, scheduler, start_at)
        start, consumed = resumed.iteration, resumed.consumed_samples
        mark_weights_changed()  # weights were loaded: no cache may serve a copy made before
        # FP8 primary weights (fp8_params.py): held as FP8 W through forward and backward, bf16 only around the
        # optimizer step (which writes bf16(master)), evaluation and checkpoints
        primary = attach_fp8_params(model) if cfg.fp8.params else None
        if primary is not None:
            primary.release()
        dp_rank = parallel_state.get_data_parallel_rank()
        # each data-parallel rank reads its own share of each global batch
        train_iter = data_mod.rank_batches(train_ds, t.micro_batch_size, n_micro, t.global_batch_size, consumed, dp_rank, device)
        forward_backward = get_forward_backward_func()
        step_fn = _forward_step()
        metrics = Metrics(cfg, rank, start, sinks)
        stack.callback(metrics.close)
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        flops_per_step = flops.model_flops_per_step(
            cfg, padded_vocab(vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
        )
        peak = flops.device_peak_flops(device)
        if rank == 0:
            from .. import __version__

            n_params = sum(p.numel() for p in model.parameters())
            # which experts an MoE model runs (TEGroupedMLP: grouped GEMMs; SequentialMLP: a GEMM per expert)
            moe = next((m for m in model.modules() if hasattr(m, "router")), None)
            experts = None if moe is None else type(moe.experts).__name__
            # routed: tokens from the router straight into the grouped FP8 layout (megatron/moe.py), else why not
            off = getattr(moe, "routed_dispatch_off", "not an Fp8MoELayer")
            dispatch = None if moe is None else ("routed" if off is None else f"megatron ({off})")
            metrics.log({"event": "start", "run_id": start_at.run_id, "version": __version__, "params": n_params,
                         "param_bytes": param_bytes(model), "fp8_params": bool(cfg.fp8.params),
                         "fp8": cfg.fp8.mode, "backend": cfg.backend.name, "backend_resolved": backend,
                         "device": str(device), "world_size": dist.get_world_size(), "tp": cfg.parallel.tp,
                         "pp": cfg.parallel.pp, "sp": bool(cfg.parallel.sequence_parallel),
                         "ep": parallel_state.get_expert_model_parallel_world_size(), "dp": dp,
                         "start_step": start, "experts": experts, "moe_dispatch": dispatch})  # fmt: skip
            if resumed.path is not None:
                metrics.log({"event": "resume", "checkpoint": str(resumed.path), "source": start_at.source, "step": start,
                             "changed": {k: list(v) for k, v in resumed.changed.items()},
                             "dropped_records": dropped})  # fmt: skip
        last = {}
        window_t, window_steps = time.perf_counter(), 0
        for step in range(start, t.steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            if primary is not None:
                primary.release()
            losses = forward_backward(
                forward_step_func=step_fn, data_iterator=train_iter, model=[model], num_microbatches=n_micro,
                seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size, forward_only=False,
            )  # fmt: skip
            if step == start:  # the FP8 weights the step's backward used (the caches, or the FP8 primary weights)
                cache_bytes = fp8_cache_bytes(model)
            if primary is not None:
                primary.restore()
            ok, grad_norm, _ = optimizer.step()
            if primary is not None and not ok:
                raise RuntimeError(f"step {step + 1}: the optimizer skipped its update, so the weights it should have "
                                   "written (fp8.params=true) hold NaN")  # fmt: skip
            mark_weights_changed()  # whatever path the optimizer wrote the weights through
            scheduler.step(increment=1)
            consumed += t.global_batch_size
            window_steps += 1
            metrics.advance()
            loss = _batch_mean(losses)
            if parallel_state.is_pipeline_last_stage() and not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step + 1}")
            if (step + 1) % cfg.logging.log_interval == 0 or step + 1 == t.steps or step == start:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - window_t) / window_steps
                last = {"step": step + 1, "loss": loss, "lr": scheduler.get_lr(optimizer.param_groups[0]),
                        "grad_norm": float(grad_norm or 0.0), "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                        "mfu": flops.mfu(flops_per_step, dt, dist.get_world_size(), peak),
                        "memory_bytes": _memory_bytes(device), "consumed_samples": consumed, "update_ok": bool(ok)}  # fmt: skip
                if step == start:
                    last["fp8_cache_bytes"] = cache_bytes
                metrics.log(last)
                window_t, window_steps = time.perf_counter(), 0
            paused = time.perf_counter()  # evaluation and saves stay out of the step time
            if t.eval_interval and ((step + 1) % t.eval_interval == 0 or step + 1 == t.steps):
                metrics.log({"step": step + 1, "valid_loss": evaluate(cfg, model, valid_ds, device, step_fn, n_micro)})
            every = cfg.checkpoint.save_interval
            if cfg.checkpoint.dir and (step + 1 == t.steps or (every and (step + 1) % every == 0)):
                saved = save_checkpoint(cfg, model, optimizer, scheduler, step + 1, consumed, run_info)
                metrics.log({"event": "checkpoint", "step": step + 1, "path": str(saved.path), "bytes": saved.bytes,
                             "seconds": saved.seconds, "pruned": saved.pruned})  # fmt: skip
            window_t += time.perf_counter() - paused
        metrics.close()
        summary = {"final": last, "metrics": str(metrics.path), "steps": t.steps}
        if rank == 0:
            metrics.log({"event": "end", **{k: v for k, v in last.items() if k in ("step", "loss", "tokens_per_s")}})
        dist.barrier()
        dist.destroy_process_group()
        return summary


def evaluate(cfg, model, dataset, device, step_fn, n_micro) -> float:
    """Mean token loss over ``train.eval_steps`` global batches of ``dataset`` from its start, split
    into ranks and micro-batches as in training (so the value does not depend on the split)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = cfg.train
    it = data_mod.rank_batches(
        dataset, t.micro_batch_size, n_micro, t.global_batch_size, 0, parallel_state.get_data_parallel_rank(), device
    )
    reports = []
    model.eval()
    with torch.no_grad():
        for _ in range(t.eval_steps):
            reports += get_forward_backward_func()(
                forward_step_func=step_fn, data_iterator=it, model=[model], num_microbatches=n_micro,
                seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size, forward_only=True,
            )  # fmt: skip
    model.train()
    return _batch_mean(reports)
