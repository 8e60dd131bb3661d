"""Megatron-LM's own ``pretrain_gpt.py`` as the client: the plugin's specs against TE and BF16.

Runs ``pretrain_gpt.py`` from a user's Megatron-LM checkout (``--megatron-lm PATH``; the
megatron-core wheel ships ``megatron.training`` but not ``pretrain_gpt.py``, ``gpt_builders.py``,
``model_provider.py``) on mock data, once per arm, one GPU, and prints per arm the median
ms/iteration after warm-up, tokens/s, Megatron's TFLOP/s/GPU, the first and last ``lm loss``, the
peak allocated memory over the run and (plugin arms) how many of the plugin's FP8 layers the built model
holds, with ratios against a chosen arm (default ``te_fp8``). ``--rounds R`` runs every arm R times, the order
reversed every other round, and reports the median of its rounds (each round's figure in the table): one arm's
iterations vary by ~10% and whole runs by several percent across a call on the H200, so 1-2% claims want R >= 2::

    python benchmarks/megatron_lm.py --megatron-lm ~/Megatron-LM --model llama8b_4l \\
        --arms plugin_fast,plugin,local_bf16,te_fp8,te_bf16,te_hybrid --iters 20 --json out.json --plot out.png

Memory with FP8 primary weights (every arm under the distributed optimizer, peak allocated against TE BF16's)::

    python benchmarks/megatron_lm.py --megatron-lm ~/Megatron-LM --model llama70b_2l --distributed-optimizer \\
        --arms plugin_fast_fp8w,plugin_fast,te_fp8_pg,te_fp8,te_bf16 --ref te_bf16 --iters 20 --json out.json

Arms (``--arms``; ``--extra-arm NAME='ARGS'`` adds one):

* ``plugin_fast`` the plugin's TE-free fast spec ``fp8_gpt_fast_layer_spec`` (``--transformer-impl local``;
  no TE, no apex): SDPA attention, fused norm+quantization, fused SwiGLU+quantization, the plugin's RoPE;
  ``--no-create-attention-mask-in-dataloader``, so that SDPA runs its causal flash kernel;
* ``plugin``      the plugin's unfused ``--spec`` object (``--transformer-impl local``; Megatron's attention);
* ``local_bf16``  Megatron's local spec in BF16 (the same flags, no ``--spec``);
* ``te_fp8``      TE's spec under ``--fp8-format e4m3 --fp8-recipe blockwise``;
* ``te_bf16``     TE's spec in BF16;
* ``te_hybrid``   ``fp8_te_gpt_layer_spec``: TE's spec (attention, RoPE) with the plugin's fused FP8 linears
  (``--transformer-impl transformer_engine``, no ``--fp8-format``);
* ``te_fp8_pg``    ``te_fp8`` with ``--fp8-param-gather`` (TE's FP8 weights, gathered in FP8; needs
  ``--distributed-optimizer``);
* ``plugin_fp8w``, ``plugin_fast_fp8w``: ``plugin`` / ``plugin_fast`` with FP8 primary weights
  (``PRIMUS_FP8_PARAMS=1``: between steps each linear's weight is held as FP8 W only, W^T made per dgrad;
  ``primus_fp8_plugin/fp8_params.py``);
* ``plugin_fast_mdisp``: ``plugin_fast`` with Megatron's own MoE token dispatcher (``PRIMUS_FP8_MOE_ROUTED=0``:
  the permuted bf16 copy and the dispatcher's host reads; ``plugin_fast`` routes tokens straight into the grouped
  FP8 layout, ``megatron/moe.py``): the routed layer's gain, measured;
* ``plugin_fast_single``: ``plugin_fast`` with one ``[E, out, in]`` weight per grouped linear
  (``PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT=1``) instead of one parameter per expert (``weight0..``, TE's layout): the
  per-parameter work of autograd, Megatron's DDP hooks and the optimizer, measured;
* ``plugin_fast_flash``: ``plugin_fast`` with ``PRIMUS_FP8_SDPA_KERNELS=flash,efficient,math`` (PyTorch's flash
  attention kernel first; ``plugin_fast`` puts cuDNN's first on Hopper);
* ``plugin_fast_graph``, ``te_bf16_graph``, ``te_fp8_graph``: those arms under Megatron's own per-layer CUDA
  graphs, ``--cuda-graph-impl local`` (``CudaGraphManager``: every ``TransformerLayer``'s forward and backward
  captured at the end of the first iteration, after ``--cuda-graph-warmup-steps`` eager runs, and replayed from
  the second on; embedding, final norm, loss and optimizer stay eager). The same mechanism for the plugin's
  TE-free layers and for TE's (Megatron turns on ``--te-rng-tracker`` for TE's); the plugin's run needs no
  TE (Megatron's own graph-safe RNG tracker). See docs/CUDA_GRAPHS.md. ``plugin_fast_single_graph``:
  ``plugin_fast_single`` so captured (on MoE models the routed MoE layer is captured whole, router and experts).

For MoE models the TE arms (``te_hybrid`` too) add ``--moe-grouped-gemm``; the plugin arms add it when
``--plugin-grouped`` is given (the specs honour it) and for the fine-grained MoE proxies, whose point is the grouped
experts:

* ``qwen3_30b_a3b_proxy``: Qwen3-30B-A3B's layer (hidden 2048, 32 query heads of 128 in 4 KV groups, q/k norms,
  128 experts of FFN 768, top-8, aux loss), 4 layers, sequence 4096;
* ``dsv3_proxy``: a DeepSeek-V3-like MoE (64 routed experts of FFN 2048, top-8, one shared expert of FFN 2048,
  sigmoid router scores with an expert bias and top-k scaling 2.5, sequence aux loss) at hidden 2048 with GQA
  attention instead of MLA, 4 layers, sequence 4096 (a single-GPU proxy of the expert shapes, not the model).

``--profile`` profiles one iteration of every arm with Megatron-LM's own switch (``--profile
--use-pytorch-profiler``: a PyTorch profiler chrome trace; with Python frames, ``--pytorch-profiler-collect-callstack``,
where the installed Megatron has it) and prints the share of that step in which a GPU kernel runs, the kernel time by
category (GEMM, attention, quantization, permutation, elementwise, optimizer, ...) and what the host was doing while
no kernel ran (``kernel_profile.py``); the row and ``--json`` carry it. The profiled iteration runs with the profiler's overhead:
put it after the timed ones' warm-up (``--profile-step``, default the last iteration).

``--memory-peak`` records the CUDA allocator's trace in every arm (Python stacks of each allocation; slower, so not
for timing) and prints where the run's peak of allocated memory falls and what is live there, by allocation site and
step phase (``tools/memory_peak.py``); the row and ``--json`` carry it.

``pretrain()`` runs ``make`` in ``megatron/core/datasets``, whose Makefile a wheel install lacks;
when the compiled helper imports, the entry shim (``megatron_lm_entry.py``) skips that step and says
so. Each ``--spec`` is checked before any arm runs (``python -m primus_fp8_plugin.megatron.check_spec``
with the arm's flags: it imports and builds the spec, which must hold the plugin's FP8 layers), and the
plugin arms run with ``PRIMUS_FP8_CHECK_MODEL=1``: the entry shim then stops the run if the built
``GPTModel`` holds none of them (Megatron trains its default spec when a ``--spec`` import fails).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (HERE, ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import kernel_profile  # noqa: E402 - benchmarks/ on the path first

from tools import memory_peak  # noqa: E402

# flags a run without TE and apex needs (Megatron's fused kernels come from them)
TE_FREE = ("--transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion "
           "--no-gradient-accumulation-fusion --no-rope-fusion")  # fmt: skip

# the fast spec's SDPA runs its causal flash kernel when no mask is given (TE ignores the causal mask anyway);
# with the dataloader's [b, 1, s, s] mask it takes the memory-efficient kernel and expands the KV heads
NO_MASK = "--no-create-attention-mask-in-dataloader"

# TE's arms: Megatron's output layer still wants apex's fused wgrad unless told otherwise
TE_ARM = "--transformer-impl transformer_engine --no-gradient-accumulation-fusion"

# Megatron-core's per-layer CUDA graphs (megatron/core/transformer/cuda_graphs.py): the graph arms add this
GRAPH = "--cuda-graph-impl local"

MODELS = {
    "gpt125m": dict(
        args="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
        "--max-position-embeddings 1024 --position-embedding-type learned_absolute "
        "--micro-batch-size 8 --global-batch-size 64 --normalization LayerNorm",
        spec="fp8_gpt_layer_spec",
        moe=False,
    ),
    "llama8b_4l": dict(
        args="--num-layers 4 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048 "
        "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
        "--untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 16",
        spec="fp8_gpt_layer_spec_rmsnorm",
        moe=False,
    ),
    # the 70B-width dense proxy: two layers at Llama-3-70B width (docs/PERFORMANCE.md, FP8 primary weights)
    "llama70b_2l": dict(
        args="--num-layers 2 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
        "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 "
        "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
        "--untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size 8",
        spec="fp8_gpt_layer_spec_rmsnorm",
        moe=False,
    ),
    "qwen3_30b_a3b_proxy": dict(
        args="--num-layers 4 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm --seq-length 4096 "
        "--max-position-embeddings 4096 --position-embedding-type rope --rotary-base 1000000 --swiglu "
        "--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
        "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-token-dispatcher-type alltoall "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --micro-batch-size 1 "
        "--global-batch-size 8",
        spec="fp8_gpt_moe_layer_spec",
        moe=True,
        plugin_grouped=True,
    ),
    "dsv3_proxy": dict(
        args="--num-layers 4 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 "
        "--group-query-attention --num-query-groups 4 --kv-channels 128 --seq-length 4096 "
        "--max-position-embeddings 4096 --position-embedding-type rope --swiglu --normalization RMSNorm "
        "--disable-bias-linear --untie-embeddings-and-output-weights --num-experts 64 --moe-router-topk 8 "
        "--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-score-function sigmoid "
        "--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-token-dispatcher-type alltoall "
        "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --micro-batch-size 1 "
        "--global-batch-size 8",
        spec="fp8_gpt_moe_layer_spec",
        moe=True,
        plugin_grouped=True,
    ),
    "moe_proxy": dict(
        args="--num-layers 4 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 "
        "--seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --swiglu "
        "--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
        "--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 1408 "
        "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 1e-2 --micro-batch-size 4 --global-batch-size 32",
        spec="fp8_gpt_moe_layer_spec",
        moe=True,
    ),
}

COMMON = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 --lr 3e-4 --min-lr 3e-5 "
          "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 "
          "--init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 --seed 1234 "
          "--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000000 "
          "--distributed-timeout-minutes 10 --log-memory-interval 5")  # fmt: skip

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|(.*)")
FIELD_RE = {
    "ms": re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)"),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)"),
    "loss": re.compile(r"lm loss: ([-\d.E+]+)"),
    "gbs": re.compile(r"global batch size:\s+(\d+)"),
}
FP8_RE = re.compile(r"\[primus_fp8_plugin\] GPTModel holds (\d+) FP8 layers")
MEM_RE = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)")


def parse_log(text: str) -> dict:
    """Per-iteration figures and peak memory from a ``pretrain_gpt.py`` log (rank 0's stdout)."""
    iters = []
    for line in text.splitlines():
        m = ITER_RE.search(line)
        if not m:
            continue
        rec = {"iteration": int(m.group(1))}
        for key, rx in FIELD_RE.items():
            f = rx.search(m.group(3))
            if f:
                rec[key] = float(f.group(1))
        if "ms" in rec:
            iters.append(rec)
    peaks = [float(m.group(3)) for m in MEM_RE.finditer(text)]
    fp8 = [int(m.group(1)) for m in FP8_RE.finditer(text)]
    return {"iterations": iters, "max_allocated_mb": max(peaks) if peaks else None, "fp8_layers": sum(fp8) if fp8 else None}


def summarize(parsed: dict, seq_length: int, warmup: int) -> dict:
    """Median ms/iteration (and TFLOP/s) over the iterations after ``warmup``; tokens/s from it."""
    its = parsed["iterations"]
    timed = [r for r in its if r["iteration"] > warmup]
    if not timed:
        raise ValueError(f"no iteration after the first {warmup} in the log ({len(its)} logged): "
                         "raise --iters or lower --warmup")  # fmt: skip
    ms = statistics.median(r["ms"] for r in timed)
    gbs = timed[-1].get("gbs")
    tfl = [r["tflops"] for r in timed if "tflops" in r]
    losses = [r["loss"] for r in its if "loss" in r]
    return {
        "ms_per_iter": ms,
        "ms_spread": [min(r["ms"] for r in timed), max(r["ms"] for r in timed)],
        "tokens_per_s": gbs * seq_length / (ms / 1000.0) if gbs else None,
        "tflops_per_gpu": statistics.median(tfl) if tfl else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "max_allocated_mb": parsed["max_allocated_mb"],
        "fp8_layers": parsed.get("fp8_layers"),
        "timed_iterations": len(timed),
    }


GRAPH_ARMS = ("plugin_fast", "te_bf16", "te_fp8")  # the arms that have a ``NAME_graph`` twin

# arms that are another arm's flags run with extra environment: SdpaAttention's SDPA kernel order; FP8 primary
# weights (megatron/fp8_params.py: hooks installed when the plugin's layers are built)
ARM_ENV = {
    "plugin_fast_flash": ("plugin_fast", {"PRIMUS_FP8_SDPA_KERNELS": "flash,efficient,math"}),
    "plugin_fp8w": ("plugin", {"PRIMUS_FP8_PARAMS": "1"}),
    "plugin_fast_fp8w": ("plugin_fast", {"PRIMUS_FP8_PARAMS": "1"}),
    "plugin_fast_mdisp": ("plugin_fast", {"PRIMUS_FP8_MOE_ROUTED": "0"}),
    "plugin_fast_single": ("plugin_fast", {"PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT": "1"}),
    "plugin_fast_single_graph": ("plugin_fast_graph", {"PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT": "1"}),
}
# Megatron's FP8 parameter all-gather (TE's FP8 weights): only with the distributed optimizer
FP8_PARAM_GATHER = "--fp8-param-gather"
DIST_OPT = "--use-distributed-optimizer"


def arm_args(arm: str, model: dict, plugin_grouped: bool) -> str:
    spec = f"--spec primus_fp8_plugin.megatron {model['spec']}"
    grouped = " --moe-grouped-gemm" if model["moe"] else ""
    plugin_grouped = grouped if plugin_grouped or model.get("plugin_grouped") else ""
    arms = {
        "plugin_fast": f"{TE_FREE} {NO_MASK} --spec primus_fp8_plugin.megatron fp8_gpt_fast_layer_spec" + plugin_grouped,
        "plugin": f"{TE_FREE} {spec}" + plugin_grouped,
        "local_bf16": TE_FREE,
        "te_fp8": f"{TE_ARM} --fp8-format e4m3 --fp8-recipe blockwise" + grouped,
        "te_fp8_pg": f"{TE_ARM} --fp8-format e4m3 --fp8-recipe blockwise {FP8_PARAM_GATHER}" + grouped,
        "te_bf16": TE_ARM + grouped,
        "te_hybrid": f"{TE_ARM} --spec primus_fp8_plugin.megatron fp8_te_gpt_layer_spec" + grouped,
    }
    for base in GRAPH_ARMS:
        arms[f"{base}_graph"] = f"{arms[base]} {GRAPH}"
    for name, (base, _) in ARM_ENV.items():
        arms[name] = arms[base]
    if arm not in arms:
        raise SystemExit(f"unknown arm {arm!r}: choose from {sorted(arms)} or give --extra-arm {arm}='ARGS'")
    return arms[arm]


def plan_arms(names: list[str], extra: dict, model: dict, plugin_grouped: bool, distributed_optimizer: bool) -> list:
    """``(arm, its flags)`` in run order: ``extra`` arms' own flags, the others' from ``arm_args``; every arm with
    ``--use-distributed-optimizer`` where ``distributed_optimizer`` (else an arm with ``--fp8-param-gather``, which
    Megatron takes with the distributed optimizer only, is a ValueError)."""
    plans = [(n, extra[n] if n in extra else arm_args(n, model, plugin_grouped)) for n in names]
    if distributed_optimizer:
        return [(n, f"{flags} {DIST_OPT}") for n, flags in plans]
    if needs := [n for n, flags in plans if FP8_PARAM_GATHER in flags]:
        raise ValueError(f"{needs}: Megatron's --fp8-param-gather works with the distributed optimizer only; give "
                         "--distributed-optimizer (every arm then runs with it: a like-for-like table)")  # fmt: skip
    return plans


def spec_of(args_str: str) -> tuple[str, str] | None:
    """``(MODULE, NAME)`` of a ``--spec MODULE NAME`` in a flag string, else None."""
    toks = shlex.split(args_str)
    if "--spec" not in toks:
        return None
    i = toks.index("--spec")
    if len(toks) < i + 3:
        raise SystemExit(f"--spec takes MODULE NAME, got {shlex.join(toks[i:])!r}")
    return toks[i + 1], toks[i + 2]


def arm_env(arm: str | None = None) -> dict:
    """The environment an arm (and its spec check) runs in: this repository first on PYTHONPATH, and the arm's
    own variables (``ARM_ENV``)."""
    env = dict(os.environ)
    env.update(ARM_ENV.get(arm, (None, {}))[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def check_spec(args_str: str, model_args: str = "", arm: str | None = None) -> str | None:
    """Import and build an arm's ``--spec MODULE NAME`` for its flags first, in a fresh interpreter with the
    arms' environment (``python -m primus_fp8_plugin.megatron.check_spec``): Megatron would log one line and
    train its default spec. Returns the check's summary line (None without ``--spec``); exits on failure."""
    spec = spec_of(args_str)
    if spec is None:
        return None
    cmd = [sys.executable, "-W", "ignore", "-m", "primus_fp8_plugin.megatron.check_spec", *spec,
           *shlex.split(model_args), *shlex.split(args_str)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=arm_env(arm))
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"--spec {' '.join(spec)}: the spec check failed (rc={res.returncode}): {why}")
    return res.stdout.strip().splitlines()[-1]


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The arms' order in each round: as given, then reversed, alternating, so that no arm always runs first or
    last (the GPU's clock and temperature drift over a call)."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def combine_rounds(runs: list[dict]) -> dict:
    """One arm's row from its rounds' rows: ms/iteration the median of the rounds' medians (tokens/s and TFLOP/s
    with it), each round's figure in ``ms_rounds``, the peak memory the highest, losses from the first round.
    A failed round makes the row the failure."""
    failed = [r for r in runs if "ms_per_iter" not in r]
    if failed:
        return failed[0]
    row = dict(runs[0])
    ms = [r["ms_per_iter"] for r in runs]
    mid = statistics.median(ms)
    row["ms_per_iter"] = mid
    row["ms_rounds"] = ms
    row["ms_spread"] = [min(r["ms_spread"][0] for r in runs), max(r["ms_spread"][1] for r in runs)]
    if runs[0]["tokens_per_s"]:
        row["tokens_per_s"] = runs[0]["tokens_per_s"] * runs[0]["ms_per_iter"] / mid
    tfl = [r["tflops_per_gpu"] for r in runs if r.get("tflops_per_gpu")]
    row["tflops_per_gpu"] = statistics.median(tfl) if tfl else None
    mem = [r["max_allocated_mb"] for r in runs if r.get("max_allocated_mb") is not None]
    row["max_allocated_mb"] = max(mem) if mem else None
    row["wall_s"] = round(sum(r["wall_s"] for r in runs), 1)
    return row


def megatron_records_callstacks() -> bool:
    """Whether the installed Megatron has ``--pytorch-profiler-collect-callstack`` (megatron-core 0.19 on): with it
    the trace holds the Python frames that ``kernel_profile.idle_by_host_frame`` charges the GPU's idle time to."""
    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.submodule_search_locations:
        return False
    config = Path(next(iter(spec.submodule_search_locations))) / "config" / "common_config.py"
    return config.is_file() and "pytorch_profiler_collect_callstack" in config.read_text()


def profile_args(step: int, root: Path, callstacks: bool = False) -> str:
    """Megatron-LM's flags that profile iteration ``step`` with the PyTorch profiler, its trace under ``root``
    (``callstacks``: with Python frames)."""
    return (f"--profile --use-pytorch-profiler --profile-step-start {step} --profile-step-end {step + 1} "
            f"--tensorboard-dir {root / 'tensorboard'}"
            + (" --pytorch-profiler-collect-callstack" if callstacks else ""))  # fmt: skip


def run_arm(name: str, extra: str, args, model: dict, log_dir: Path, tag: str = "") -> dict:
    profile_root = log_dir / f"profile_{name}{tag}"
    profiled = profile_args(args.profile_step, profile_root, megatron_records_callstacks()) if args.profile else ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(HERE / "megatron_lm_entry.py"), str(args.megatron_lm), *shlex.split(COMMON),
           *shlex.split(model["args"]), "--train-iters", str(args.iters), *shlex.split(extra),
           *shlex.split(profiled)]  # fmt: skip
    env = arm_env(name)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    peak_json = log_dir / f"memory_peak_{name}{tag}.json"
    if args.memory_peak:
        env["PRIMUS_FP8_MEMORY_PEAK"] = str(peak_json)  # the entry shim records the allocator's trace (memory_peak.py)
        peak_json.unlink(missing_ok=True)  # an earlier run's report is never read as this one's
    if (spec_of(extra) or ("",))[0].startswith("primus_fp8_plugin"):
        env["PRIMUS_FP8_CHECK_MODEL"] = "1"  # the entry shim stops the run if the model holds no FP8 layer
    log = log_dir / f"megatron_lm_{name}{tag}.log"
    print(f"[megatron_lm] {name}: {shlex.join(cmd[6:])}", flush=True)
    t0 = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text()
    row = {"arm": name, "args": extra, "env": dict(ARM_ENV.get(name, (None, {}))[1]), "rc": rc,
           "wall_s": round(time.time() - t0, 1), "log": str(log)}  # fmt: skip
    if rc != 0:
        tail = "\n".join(text.splitlines()[-25:])
        print(f"[megatron_lm] {name} failed (rc={rc}); last lines of {log}:\n{tail}", flush=True)
        return row
    seq = int(re.search(r"--seq-length (\d+)", model["args"]).group(1))
    row.update(summarize(parse_log(text), seq, args.warmup))
    if args.profile:
        trace = kernel_profile.find_trace(profile_root)
        if trace is None:
            print(f"[megatron_lm] {name}: --profile wrote no trace under {profile_root}", flush=True)
        else:
            row["profile"] = kernel_profile.step_profile(kernel_profile.load_trace(trace), top_names=0)
            row["profile"]["trace"] = str(trace)
            print(f"[megatron_lm] {name} profile ({trace}):\n{kernel_profile.format_profile(row['profile'])}", flush=True)
    if args.memory_peak:
        if peak_json.is_file():
            report = json.loads(peak_json.read_text())
            row["memory_peak"] = {k: v for k, v in report.items() if k != "timeline"}  # the plot keeps the timeline
            print(f"[megatron_lm] {name} {memory_peak.format_report(report)}", flush=True)
            try:
                memory_peak.plot_report(report, peak_json.with_suffix(".png"), f"pretrain_gpt.py, {name}")
            except ImportError:  # matplotlib is optional
                pass
        else:
            print(f"[megatron_lm] {name}: --memory-peak wrote no report ({peak_json})", flush=True)
    print(f"[megatron_lm] {name}: {row['ms_per_iter']:.1f} ms/iter, first loss {row['first_loss']}, "
          f"last loss {row['last_loss']} ({row['wall_s']} s)", flush=True)  # fmt: skip
    return row


def multi_tensor_kernels() -> str:
    """Where Megatron's optimizer gets its multi-tensor kernels (gradient norm, scaling) in this environment: TE's,
    apex's, or its Python fallbacks, which read one value per parameter tensor on the host for the gradient norm (a
    device synchronisation each: about a thousand a step for fine-grained MoE), so a step without TE or apex is not
    a production one."""
    for source, modules in (("TE", ("transformer_engine.pytorch.optimizers",)),
                            ("apex", ("amp_C", "apex.multi_tensor_apply"))):  # what megatron/core/optimizer tries
        try:
            for module in modules:
                importlib.import_module(module)
        except Exception:  # noqa: BLE001 - an install that does not import is no source
            continue
        return source
    return ("Megatron's Python fallbacks (no TE, no apex): one host read per parameter in the gradient norm; "
            "install TE or apex for production figures")  # fmt: skip


def print_kernel_differences(rows: list[dict], ref: str) -> None:
    """With ``--profile``: per arm, the kernel names its profiled step launched a different number of times than
    ``ref``'s (the first profiled arm where ``ref`` has no profile)."""
    profiled = [r for r in rows if "profile" in r]
    base = next((r for r in profiled if r["arm"] == ref), profiled[0] if profiled else None)
    for r in profiled:
        if r is not base:
            rows_diff = kernel_profile.compare_kernels(base["profile"], r["profile"])
            print(f"\n{base['arm']} (A) -> {r['arm']} (B), profiled steps: {kernel_profile.format_comparison(rows_diff)}")


def print_table(rows: list[dict], ref: str) -> None:
    base = next((r for r in rows if r["arm"] == ref and "ms_per_iter" in r), None)
    cols = ["arm", "ms/iter", f"vs {ref}", "tokens/s", "TFLOP/s", "first loss", "last loss", "max alloc MB", "FP8 layers"]
    rounds = any(len(r.get("ms_rounds", ())) > 1 for r in rows)
    if rounds:
        cols.append("rounds ms/iter")
    profiled = any("profile" in r for r in rows)
    if profiled:
        cols.append("GPU busy")
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for r in rows:
        if "ms_per_iter" not in r:
            print(f"{r['arm']} | failed (rc={r['rc']}, see {r['log']})")
            continue
        ratio = f"{base['ms_per_iter'] / r['ms_per_iter']:.3f}x" if base else "-"

        def fmt(v, spec):
            return "-" if v is None else format(v, spec)

        cells = [r["arm"], f"{r['ms_per_iter']:.1f}", ratio, fmt(r["tokens_per_s"], ".0f"),
                 fmt(r["tflops_per_gpu"], ".1f"), fmt(r["first_loss"], ".6f"), fmt(r["last_loss"], ".6f"),
                 fmt(r["max_allocated_mb"], ".0f"), fmt(r.get("fp8_layers"), "d")]  # fmt: skip
        if rounds:
            cells.append(" / ".join(f"{m:.1f}" for m in r.get("ms_rounds", [r["ms_per_iter"]])))
        if profiled:
            cells.append(f"{100 * r['profile']['busy_share']:.1f}%" if "profile" in r else "-")
        print(" | ".join(cells))
    print(f"(ratio = {ref}'s ms/iter over the arm's: above 1 is faster than {ref})")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "ms_per_iter" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([r["arm"] for r in ok], [r["ms_per_iter"] for r in ok], color="tab:blue")
    a.set_ylabel("ms / iteration (median)")
    a.set_title(title)
    for r in ok:
        its = [x for x in parse_log(Path(r["log"]).read_text())["iterations"] if "loss" in x]
        b.plot([x["iteration"] for x in its], [x["loss"] for x in its], label=r["arm"])
    b.set_xlabel("iteration")
    b.set_ylabel("lm loss")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", type=Path, required=True, help="a Megatron-LM checkout (holds pretrain_gpt.py)")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama8b_4l")
    ap.add_argument("--arms", default="plugin,local_bf16,te_fp8,te_bf16", help="comma list of arms, in run order")
    ap.add_argument(
        "--extra-arm", action="append", default=[], metavar="NAME=ARGS", help="another arm: its pretrain_gpt.py flags"
    )
    ap.add_argument("--plugin-grouped", action="store_true", help="MoE: pass --moe-grouped-gemm to the plugin arm too")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="every arm with --use-distributed-optimizer (te_fp8_pg needs it)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the median")
    ap.add_argument("--ref", default="te_fp8", help="the arm the ratios compare with")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every arm this many times, the order reversed every other round; median of the rounds")  # fmt: skip
    ap.add_argument("--log-dir", type=Path, default=Path("outputs/megatron_lm"))
    ap.add_argument("--profile", action="store_true",
                    help="profile one iteration per arm: GPU-busy share and kernel time by category")  # fmt: skip
    ap.add_argument("--profile-step", type=int, help="the iteration --profile records (default: the last)")
    ap.add_argument("--memory-peak", action="store_true",
                    help="record the CUDA allocator's trace per arm and print where its peak falls and what is live "
                    "there, by allocation site (tools/memory_peak.py; slows the run: not for timing)")  # fmt: skip
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if not (args.megatron_lm / "pretrain_gpt.py").is_file():
        ap.error(f"{args.megatron_lm} has no pretrain_gpt.py: give the root of a Megatron-LM checkout")
    if args.iters <= args.warmup:
        ap.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.profile_step is None:
        args.profile_step = args.iters - 1
    if args.profile and not args.warmup < args.profile_step < args.iters:
        ap.error(f"--profile-step ({args.profile_step}) must lie after the warm-up ({args.warmup}) and before --iters")
    model = MODELS[args.model]
    extra = {}
    for item in args.extra_arm:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            ap.error(f"--extra-arm takes NAME=ARGS, got {item!r}")
        extra[name] = flags
    names = [a for a in args.arms.split(",") if a] + [n for n in extra if n not in args.arms.split(",")]
    try:
        plans = plan_arms(names, extra, model, args.plugin_grouped, args.distributed_optimizer)
    except ValueError as err:
        ap.error(str(err))
    for name, flags in plans:
        summary = check_spec(flags, model["args"], name)
        if summary:
            print(f"[megatron_lm] {name}: {summary}", flush=True)
    kernels = multi_tensor_kernels()
    print(f"[megatron_lm] Megatron's multi-tensor kernels: {kernels}", flush=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    flags_of = dict(plans)
    runs: dict[str, list[dict]] = {n: [] for n in flags_of}
    for r, order in enumerate(round_orders(list(flags_of), args.rounds)):
        for n in order:
            tag = f"_r{r + 1}" if args.rounds > 1 else ""
            runs[n].append(run_arm(n, flags_of[n], args, model, args.log_dir, tag))
    rows = [combine_rounds(runs[n]) for n in flags_of]
    rounds = f", median of {args.rounds} rounds in alternating order" if args.rounds > 1 else ""
    print(f"\nMegatron-LM pretrain_gpt.py, model {args.model}, {args.iters} iterations (median after {args.warmup}){rounds}:")
    print_table(rows, args.ref)
    print_kernel_differences(rows, args.ref)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "model_args": model["args"], "common": COMMON,
                                               "rounds": args.rounds, "multi_tensor_kernels": kernels, "rows": rows,
                                               "runs": runs}, indent=1))  # fmt: skip
    if args.plot:
        plot(rows, args.plot, f"pretrain_gpt.py, {args.model}")
    return 0 if all("ms_per_iter" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
