"""Convert a plain PyTorch model's linear layers to FP8 blockwise, see which were converted, train it.

    python docs/examples/convert_pytorch.py                        # the CPU, or the GPU if there is one
    python docs/examples/convert_pytorch.py --steps 40 --backend reference

The model is a small classifier over token sequences: an embedding, ``nn.MultiheadAttention``, an MLP, and
a head with 10 classes. ``convert_to_fp8_blockwise(model, filter, report=True)`` swaps each ``nn.Linear``
the plugin takes for an ``Fp8BlockwiseLinear`` that holds the same weight and bias Parameters, and returns
a report of every linear it converted or left as it was, and why: here the first projection is kept in
bf16 by the filter (the user's choice), the attention's ``out_proj`` is a subclass that
``nn.MultiheadAttention`` reads without calling, and the head's 10 outputs are not a multiple of 16.
Then AdamW trains the converted model on one fixed batch of random tokens and labels, which it
memorises: the loss falls step by step.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from primus_fp8_plugin import convert_to_fp8_blockwise

VOCAB, WIDTH, CLASSES = 512, 128, 10


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.proj_in = nn.Linear(WIDTH, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [b, s] -> logits [b, CLASSES]
        x = self.proj_in(self.embed(tokens))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = x + self.mlp(self.norm(x))
        return self.head(x.mean(dim=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    ap.add_argument("--backend", default="auto", help="the plugin's kernels: auto, reference, triton, cublas, hopper")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    model = Classifier().to(device=device, dtype=torch.bfloat16)
    model, report = convert_to_fp8_blockwise(
        model, module_filter_fn=lambda module, fqn: fqn != "proj_in", backend=args.backend, report=True
    )
    print(report, flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (32, 64), generator=g).to(device)
    labels = torch.randint(0, CLASSES, (32,), generator=g).to(device)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens).float(), labels)
        loss.backward()
        optimizer.step()  # the FP8 layers re-quantize their weights after every optimizer step
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
