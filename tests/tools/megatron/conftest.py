import pytest

pytest.importorskip("megatron.core")
