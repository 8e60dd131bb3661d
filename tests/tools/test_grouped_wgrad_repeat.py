"""tools/grouped_wgrad_repeat.py without an sm_90 GPU: it says what it needs instead of failing inside torch."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_hopper_gpu():
    from tools import grouped_wgrad_repeat

    with pytest.raises(SystemExit, match="needs an NVIDIA sm_90 GPU"):
        grouped_wgrad_repeat.main(["--reps", "1"])
