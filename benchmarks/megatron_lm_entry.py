"""Runs a Megatron-LM checkout's ``pretrain_gpt.py`` (``python megatron_lm_entry.py CHECKOUT ARGS...``).

``megatron.training`` compiles the dataset helpers with ``make`` in ``megatron/core/datasets``
before training. A megatron-core wheel ships the compiled helper but no Makefile, so that ``make``
fails; when the helper already imports, this shim skips the step (and says so) instead. Everything
else is Megatron-LM's own code, run unchanged with the checkout first on ``sys.path``.

With ``PRIMUS_FP8_CHECK_MODEL=1`` every ``GPTModel`` built prints how many of primus_fp8_plugin's FP8 layers
it holds and the run stops if it holds none (``check_spec.install_model_check``): Megatron trains its
default spec when the ``--spec`` import fails.

With ``PRIMUS_FP8_MEMORY_PEAK=REPORT.json`` the CUDA allocator records every allocation and free with its Python stack
from the start, and at exit rank 0 writes ``tools/memory_peak.py``'s report of its peak there, with
``torch.cuda.max_memory_allocated`` beside it.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def _skip_compile_if_built() -> None:
    from megatron.core.datasets import utils

    makefile = Path(utils.__file__).with_name("Makefile")
    if makefile.exists():
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"megatron/core/datasets has no Makefile and no compiled helpers_cpp ({err}): "
                         "install megatron-core from a wheel that ships it, or from a source checkout") from err  # fmt: skip

    def compile_helpers():
        print(f"> dataset helpers: {makefile.parent} has no Makefile; using the compiled helpers_cpp", flush=True)

    utils.compile_helpers = compile_helpers


def _record_memory_peak(report_path: Path) -> None:
    import atexit
    import json

    import torch

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(1, str(root))
    from tools.memory_peak import peak_report

    max_entries = 2_000_000  # events kept (a ring buffer); with Python stacks, several GB of host memory when full
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)

    def write_report() -> None:
        if os.environ.get("RANK", "0") != "0":  # one report, rank 0's
            return
        device = torch.cuda.current_device()
        report = peak_report(torch.cuda.memory._snapshot(), device=device, max_entries=max_entries)
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        report_path.write_text(json.dumps(report, indent=1))
        torch.cuda.memory._record_memory_history(enabled=None)

    atexit.register(write_report)


def main() -> None:
    if len(sys.argv) < 2 or not (Path(sys.argv[1]) / "pretrain_gpt.py").is_file():
        raise SystemExit("usage: megatron_lm_entry.py MEGATRON_LM_CHECKOUT [pretrain_gpt.py args...]")
    checkout = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(checkout))
    _skip_compile_if_built()
    if os.environ.get("PRIMUS_FP8_CHECK_MODEL") == "1":
        from primus_fp8_plugin.megatron.check_spec import install_model_check

        install_model_check()
    if os.environ.get("PRIMUS_FP8_MEMORY_PEAK"):
        _record_memory_peak(Path(os.environ["PRIMUS_FP8_MEMORY_PEAK"]))
    sys.argv = [str(checkout / "pretrain_gpt.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
