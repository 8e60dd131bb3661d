"""The training loop: Megatron's DDP, optimizer, LR schedule and forward-backward schedule, with
metrics (JSONL), a progress bar, evaluation and exact save/resume through distributed checkpoints."""

from __future__ import annotations

import contextlib
import json
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
from ..config.schema import ConfigError
from . import data as data_mod
from .model import build_model, transformer_config


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


class Metrics:
    """JSONL metrics (rank 0) and a progress bar."""

    def __init__(self, cfg, rank: int, start: int):
        self.rank = rank
        self.path = Path(cfg.logging.dir) / "metrics.jsonl"
        self.bar = None
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if cfg.logging.progress:
                from tqdm import tqdm

                self.bar = tqdm(total=cfg.train.steps, initial=start, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if self.rank != 0:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
        if self.bar is None:
            print(line, flush=True)
        elif "event" not in record and {"loss", "lr", "tokens_per_s"} <= record.keys():  # a training step
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
        else:  # validation losses and events: a line above the bar
            self.bar.write(line)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None  # later records (the end event) print as lines


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def _forward_step():
    def step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].float()

        def loss_func(per_token):
            loss = (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return step


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _checkpoint_state(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool = False) -> dict:
    inner = model.module  # DDP's own (sharded_)state_dict would prefix every key with "module."
    kw = {"is_loading": True} if loading else {}
    return {
        "model": inner.sharded_state_dict(),
        "optimizer": optimizer.sharded_state_dict(inner.sharded_state_dict(), **kw),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng": _rng_state(),
    }


def save_checkpoint(cfg, model, optimizer, scheduler, iteration: int, consumed: int) -> Path:
    from megatron.core import dist_checkpointing

    path = Path(cfg.checkpoint.dir) / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_checkpoint_state(model, optimizer, scheduler, iteration, consumed), str(path))
    if dist.get_rank() == 0:
        (Path(cfg.checkpoint.dir) / "latest.txt").write_text(path.name)
    dist.barrier()
    return path


def load_checkpoint(cfg, model, optimizer, scheduler) -> tuple[int, int]:
    """(iteration, consumed samples) of the latest checkpoint, loaded into the objects; (0, 0) if none."""
    from megatron.core import dist_checkpointing

    latest = Path(cfg.checkpoint.dir or "") / "latest.txt"
    if not (cfg.checkpoint.dir and cfg.checkpoint.resume and latest.exists()):
        return 0, 0
    path = latest.parent / latest.read_text().strip()
    state = dist_checkpointing.load(_checkpoint_state(model, optimizer, scheduler, 0, 0, loading=True), str(path))
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return int(state["iteration"]), int(state["consumed_samples"])


def run(cfg) -> dict:
    """Train as ``cfg`` says. Returns a summary (final loss, tokens/s, steps, paths)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device, stack = init_runtime(cfg)
    with stack:
        rank = dist.get_rank()
        dp = parallel_state.get_data_parallel_world_size()
        t = cfg.train
        n_micro = t.global_batch_size // (t.micro_batch_size * dp)

        # data: rank 0 writes the corpus once, everyone reads it
        if cfg.data.source == "stdlib":
            if rank == 0:
                data_mod.build_stdlib_corpus(cfg.data.cache_dir, cfg.data.max_bytes)
            dist.barrier()
            prefix = data_mod.build_stdlib_corpus(cfg.data.cache_dir, cfg.data.max_bytes, log=lambda *_: None)
        else:
            prefix = cfg.data.path
        n_evals = t.steps // max(t.eval_interval, 1) + 1
        sizes = [t.steps * t.global_batch_size, n_evals * t.eval_steps * t.micro_batch_size * dp, 0]
        train_ds, valid_ds, _ = data_mod.build_datasets(
            prefix, cfg.model.seq_length, t.seed, cfg.data.split, sizes, cfg.data.cache_dir
        )

        tconfig = transformer_config(cfg, device.type == "cuda")
        model = build_model(cfg, tconfig, data_mod.ByteTokenizer.vocab_size, device)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer
        )
        model = DistributedDataParallel(tconfig, ddp_config, model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=0.9,
                            adam_beta2=0.95, bf16=True, clip_grad=t.clip_grad,
                            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer),
            [model],
        )  # fmt: skip
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.warmup_steps,
            lr_decay_steps=t.steps, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=t.steps, wd_incr_style="constant",
        )  # fmt: skip
        start, consumed = load_checkpoint(cfg, model, optimizer, scheduler)
        dp_rank = parallel_state.get_data_parallel_rank()
        # each data-parallel rank reads its own interleaved share of the global batch
        train_iter = data_mod.batches(train_ds, t.micro_batch_size, consumed + dp_rank * t.micro_batch_size * n_micro, device)
        forward_backward = get_forward_backward_func()
        step_fn = _forward_step()
        metrics = Metrics(cfg, rank, start)
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        if rank == 0:
            n_params = sum(p.numel() for p in model.parameters())
            # which experts an MoE model runs (TEGroupedMLP: grouped GEMMs; SequentialMLP: a GEMM per expert)
            experts = next((type(m.experts).__name__ for m in model.modules() if hasattr(m, "router")), None)
            metrics.log({"event": "start", "params": n_params, "fp8": cfg.fp8.mode, "backend": cfg.backend.name,
                         "device": str(device), "world_size": dist.get_world_size(), "start_step": start,
                         "experts": experts})  # fmt: skip
        last = {}
        window_t, window_steps = time.perf_counter(), 0
        for step in range(start, t.steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=step_fn, data_iterator=train_iter, model=[model], num_microbatches=n_micro,
                seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size, forward_only=False,
            )  # fmt: skip
            ok, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            consumed += t.global_batch_size
            window_steps += 1
            metrics.advance()
            loss = float(torch.stack([x["lm loss"] for x in losses]).mean()) if losses else float("nan")
            if parallel_state.is_pipeline_last_stage() and not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step + 1}")
            if (step + 1) % cfg.logging.log_interval == 0 or step + 1 == t.steps or step == start:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - window_t) / window_steps
                last = {"step": step + 1, "loss": loss, "lr": scheduler.get_lr(optimizer.param_groups[0]),
                        "grad_norm": float(grad_norm or 0.0), "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                        "memory_bytes": _memory_bytes(device), "consumed_samples": consumed, "update_ok": bool(ok)}  # fmt: skip
                metrics.log(last)
                window_t, window_steps = time.perf_counter(), 0
            if t.eval_interval and ((step + 1) % t.eval_interval == 0 or step + 1 == t.steps):
                metrics.log({"step": step + 1, "valid_loss": evaluate(cfg, model, valid_ds, device, step_fn, n_micro)})
                window_t = time.perf_counter()  # keep evaluation out of the step time
            if cfg.checkpoint.dir and cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0:
                save_checkpoint(cfg, model, optimizer, scheduler, step + 1, consumed)
        if (
            cfg.checkpoint.dir
            and t.steps > start
            and (not cfg.checkpoint.save_interval or t.steps % cfg.checkpoint.save_interval)
        ):
            save_checkpoint(cfg, model, optimizer, scheduler, t.steps, consumed)
        metrics.close()
        summary = {"final": last, "metrics": str(metrics.path), "steps": t.steps}
        if rank == 0:
            metrics.log({"event": "end", **{k: v for k, v in last.items() if k in ("step", "loss", "tokens_per_s")}})
        dist.barrier()
        dist.destroy_process_group()
        return summary


def evaluate(cfg, model, dataset, device, step_fn, n_micro) -> float:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = data_mod.batches(dataset, cfg.train.micro_batch_size, 0, device)
    losses = []
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.train.eval_steps):
            out = get_forward_backward_func()(
                forward_step_func=step_fn, data_iterator=it, model=[model], num_microbatches=1,
                seq_length=cfg.model.seq_length, micro_batch_size=cfg.train.micro_batch_size, forward_only=True,
            )  # fmt: skip
            losses += [float(x["lm loss"]) for x in out]
    model.train()
    return float(np.mean(losses)) if losses else float("nan")
