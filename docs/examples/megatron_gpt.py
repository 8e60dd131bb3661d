"""Train a Megatron-core ``GPTModel`` built with the plugin's FP8 blockwise layer spec, end to end.

    python docs/examples/megatron_gpt.py                                  # the CPU (gloo) or one GPU
    python docs/examples/megatron_gpt.py --steps 20 --layers 4 --backend reference
    torchrun --nproc-per-node 2 docs/examples/megatron_gpt.py --tp 2      # tensor parallel, 2 GPUs

What a Megatron-core training script needs around the spec, in the order below:

1. a process group and Megatron's parallel state (on a machine without a GPU: gloo and the plugin's CPU
   stand-ins, ``primus_fp8_plugin.megatron.cpu``);
2. a ``TransformerConfig`` with bf16 parameters (and Megatron's fused kernels off where neither apex nor
   Transformer Engine is installed);
3. the plugin's spec: ``get_gpt_block_spec`` (FP8 linears, norms that work with sequence parallelism,
   PyTorch's fused attention with ``core_attention="sdpa"``);
4. ``GPTModel(...)`` wrapped in ``Float16Module``, Megatron's wrapper for bf16 models: it casts every
   parameter to bf16 (``GPTModel`` makes its learned position embedding in fp32, whatever
   ``params_dtype`` says) and the last stage's output back to fp32. A bare bf16 ``GPTModel`` fails in
   its first forward ("expected m1 and m2 to have the same dtype");
5. Megatron's ``DistributedDataParallel`` (fp32 gradient buffers, ``main_grad``, which the plugin's layers
   accumulate into) and ``finalize_model_grads``;
6. ``get_megatron_optimizer``: Adam over fp32 main copies of the bf16 parameters;
7. the forward-backward schedule, ``get_forward_backward_func()``, with a ``forward_step`` that returns the
   model's output and a loss function.

The data are random tokens, one fixed batch that the model memorises: the loss falls step by step.
The example prints the FP8 layers the model holds and the loss of each step. ``--backend`` picks the
plugin's kernels (``auto``: the fastest here; on a CPU that is the exact ``reference`` backend).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings

import torch
import torch.distributed as dist

SEQ, VOCAB = 128, 1024


def init_parallel(tp: int) -> tuple[torch.device, contextlib.AbstractContextManager]:
    """(1) The process group (torchrun's environment, or one process) and Megatron's TP/PP groups. On a
    CPU: gloo, and the plugin's stand-ins for the CUDA calls Megatron makes outside the math."""
    from megatron.core import parallel_state, tensor_parallel

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        cuda_as_cpu = contextlib.nullcontext()
    else:
        from primus_fp8_plugin.megatron.cpu import CudaAsCpu, install_cpu_standins

        install_cpu_standins()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device, cuda_as_cpu = torch.device("cpu"), CudaAsCpu()  # Megatron's optimizer asks for CUDA buffers
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return device, cuda_as_cpu


def build_model(args, device: torch.device):
    """(2)-(4) TransformerConfig, the plugin's spec, GPTModel in Float16Module."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from primus_fp8_plugin import BlockwiseRecipe
    from primus_fp8_plugin.megatron import get_gpt_block_spec
    from primus_fp8_plugin.megatron.cpu import FUSIONS_OFF

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
        params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=args.tp, sequence_parallel=args.tp > 1,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=device.type == "cpu",
        **FUSIONS_OFF,  # Megatron's fused kernels need apex or TE
    )  # fmt: skip
    # TE's numerics by default (E4M3, power-of-2 scales); BlockwiseRecipe(fp8_format="HYBRID") for E5M2 gradients.
    # The TE-free fast stack (norm and SwiGLU fused with quantization) is get_gpt_fast_layer_spec().
    spec = get_gpt_block_spec(args.layers, core_attention="sdpa", recipe=BlockwiseRecipe(), backend=args.backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPTModel's deprecation notice
        gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if device.type == "cuda":
        gpt = gpt.cuda()
    return config, Float16Module(config, gpt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel when > 1)")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches of 4 sequences per step (default 2)")
    ap.add_argument("--backend", default="auto", help="the plugin's kernels: auto, reference, triton, cublas, hopper")
    args = ap.parse_args(argv)

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from primus_fp8_plugin.megatron.check_spec import model_fp8_layers

    device, cuda_as_cpu = init_parallel(args.tp)
    rank0 = dist.get_rank() == 0
    with cuda_as_cpu:
        config, model = build_model(args, device)
        if rank0:
            print(f"FP8 layers: {dict(sorted(model_fp8_layers(model).items()))}", flush=True)
        # (5) DDP: gradients land in fp32 buffers (param.main_grad); finalize_model_grads runs the data-parallel
        # reduction and the TP all-reduce of sequence-parallel norm gradients after each step's backward passes
        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        config.finalize_model_grads_func = finalize_model_grads
        # (6) the optimizer: fp32 main params, Adam
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0), [model])

        # (7) the schedule; one fixed batch of random tokens, the same on every rank of a TP group
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g).to(device)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "position_ids": torch.arange(SEQ, device=device).expand(4, SEQ)}  # fmt: skip

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # per-token losses [b, s]

            def loss_func(per_token):
                loss = per_token.float().mean()
                # the schedule divides the returned loss in place by the number of micro-batches (for the
                # backward pass): report a copy, not a view of it
                return loss, {"lm loss": loss.detach().clone()}

            return output, loss_func

        forward_backward = get_forward_backward_func()
        for step in range(1, args.steps + 1):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            reports = forward_backward(
                forward_step_func=forward_step, data_iterator=iter([batch] * args.micro_batches), model=[model],
                num_microbatches=args.micro_batches, seq_length=SEQ, micro_batch_size=4, forward_only=False,
            )  # fmt: skip
            ok, grad_norm, _ = optimizer.step()
            if rank0 and parallel_state.is_pipeline_last_stage():
                loss = torch.stack([r["lm loss"] for r in reports]).mean().item()
                print(f"step {step}: loss {loss:.4f} grad_norm {float(grad_norm or 0):.3f} update_ok {ok}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
