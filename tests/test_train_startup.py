"""Values that passed validation and then crashed or hung inside a run now stop it at start-up with
exit status 2 and a message naming the field: an explicitly named backend that cannot run on this
device (Triton on a CPU failed in step 1), a corpus whose validation split gets no documents
(Megatron's dataset builder looped forever), and an evaluation so long that Megatron's dataset index
could not be built (the process was killed for memory)."""

from __future__ import annotations

import pytest
import torch

from .test_train import train

pytest.importorskip("megatron.core")
pytest.importorskip("hydra")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")  # the stdlib corpus, built once for the module


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["backend=triton"], "backend.name: 'triton' cannot run on cpu (Triton kernels need a GPU"),
        (["data.max_bytes=100"], "data.split='98,2,0': the valid split of"),
        (["train.eval_interval=2", "train.eval_steps=1000000000000"], "train.eval_steps: the run asks for 24000000000000 valid"),
    ],
)
def test_values_that_crashed_or_hung_stop_at_start_up(tmp_path, cache_dir, overrides, message):
    if overrides == ["backend=triton"] and torch.cuda.is_available():
        pytest.skip("a GPU is visible: Triton can run")
    proc, records = train(tmp_path, "train.steps=4", f"data.cache_dir={cache_dir}", *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not records
