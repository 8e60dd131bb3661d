"""What the trainer should report, computed without its loss function, micro-batches or schedule
(for tests/test_train_metrics.py):

    python -m tests.train_reference OUT.json OVERRIDES...

With ``train.warmup_steps=1`` the learning rate of the first optimizer step is 0, so steps 1 and 2
run on the initial weights. This builds the run's initial model and datasets as the trainer does
(same seed, same construction; one process, TP=1), then computes with plain torch on each whole
global batch at once: for steps 1 and 2 the mean token cross-entropy of train samples
``[(k-1)*G, k*G)`` (``torch.nn.functional.cross_entropy`` on the model's logits) and the L2 norm
of its gradient, and the mean token cross-entropy of validation samples ``[0, eval_steps*G)`` (what
the evaluation after step 1 sees). Writes
``{"loss": {step: ...}, "grad_norm": {step: ...}, "valid_loss": ...}``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F


def _stack(samples, key):
    return torch.stack([torch.as_tensor(s[key]) for s in samples])


def mean_token_ce(model, samples) -> torch.Tensor:
    """Mean cross-entropy over the unmasked tokens of ``samples`` (one forward pass)."""
    tokens, labels, pos = _stack(samples, "tokens"), _stack(samples, "labels"), _stack(samples, "position_ids")
    mask = _stack(samples, "loss_mask").float().flatten()
    logits = model(tokens, pos, None).float()  # [b, s, vocab]
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (per_token * mask).sum() / mask.sum()


def compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from primus_fp8_plugin.train import CONFIG_DIR, _register_schema

    _register_schema()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def main(out: str, overrides: list[str]) -> None:
    from primus_fp8_plugin.training import data as data_mod
    from primus_fp8_plugin.training.loop import init_runtime
    from primus_fp8_plugin.training.model import build_model, transformer_config

    cfg = compose([*overrides, "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=false"])
    t = cfg.train
    assert t.warmup_steps == 1, "the reference holds for steps on the initial weights (train.warmup_steps=1)"
    device, stack = init_runtime(cfg)
    with stack:
        # the trainer's datasets: the stdlib corpus, train.steps global batches, and eval_steps global
        # batches for each evaluation (Megatron's GPTDataset; its sample order is fixed by the seed)
        prefix = data_mod.build_stdlib_corpus(cfg.data.cache_dir, cfg.data.max_bytes, log=lambda *_: None)
        G = t.global_batch_size
        sizes = [t.steps * G, (t.steps // t.eval_interval + 1) * t.eval_steps * G, 0]
        train_ds, valid_ds, _ = data_mod.build_datasets(
            prefix, cfg.model.seq_length, t.seed, cfg.data.split, sizes, cfg.data.cache_dir
        )
        model = build_model(cfg, transformer_config(cfg, False), data_mod.ByteTokenizer.vocab_size, device)
        result = {"loss": {}, "grad_norm": {}}
        for k in range(2):
            model.zero_grad(set_to_none=True)
            loss = mean_token_ce(model, [train_ds[k * G + i] for i in range(G)])
            loss.backward()
            grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
            result["loss"][k + 1] = loss.item()
            result["grad_norm"][k + 1] = torch.sqrt(sum((g * g).sum() for g in grads)).item()
        model.eval()
        with torch.no_grad():
            result["valid_loss"] = mean_token_ce(model, [valid_ds[i] for i in range(t.eval_steps * G)]).item()
        torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
