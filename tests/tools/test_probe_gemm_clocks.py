"""tools/probe_gemm_clocks.py refuses unknown configs and forms before it looks for a GPU."""

import pytest

from tools import probe_gemm_clocks


@pytest.mark.parametrize("argv", [["--configs", "128x256,128x999"], ["--forms", "fwd,dgrad"]])
def test_unknown_config_or_form_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_gemm_clocks.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown" in err and "128x256" in err and "wgrad_acc" in err  # names what exists
