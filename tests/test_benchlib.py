"""scripts/benchlib.PowerLog: parses nvidia-smi's CSV samples and summarises a time window (CPU, with a
stand-in nvidia-smi on PATH)."""

import math
import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from benchlib import PowerLog  # noqa: E402

# prints one sample every 20 ms (clock 1400 + i, power 690 + i) with the current time, as nvidia-smi
# --format=csv,noheader,nounits -lms=20 does, plus a line it must skip
FAKE_SMI = """#!/usr/bin/env python3
import time, datetime
print("[N/A], 0, 0, 0, 0x0", flush=True)
for i in range(200):
    now = datetime.datetime.now()
    print(now.strftime("%Y/%m/%d %H:%M:%S.") + f"{now.microsecond // 1000:03d}, {1400 + i}, {690 + i}.5, 60, 0x0000000000000004",
          flush=True)
    time.sleep(0.02)
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_power_log_window(fake_smi):
    with PowerLog(interval_ms=20) as log:
        time.sleep(0.3)
        t0 = time.time()
        time.sleep(0.5)
        t1 = time.time()
        time.sleep(0.2)
    assert len(log.samples) >= 20
    clocks = [s[1] for s in log.samples]
    assert clocks == sorted(clocks) and clocks[0] == 1400  # every sample, in order, the bad line skipped
    w = log.window(t0, t1)
    inside = [s for s in log.samples if t0 + 0.2 * (t1 - t0) <= s[0] <= t1]
    assert w["sm_mhz"] == pytest.approx(sorted(s[1] for s in inside)[len(inside) // 2], abs=1)
    assert w["power_w"] - w["sm_mhz"] == pytest.approx(-709.5)  # power 690.5 + i against clock 1400 + i
    assert w["temp_c"] == 60 and w["throttle"] == "0x0000000000000004"
    assert math.isnan(log.window(t1 + 100, t1 + 200)["sm_mhz"])


def test_power_log_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to run: records nothing, no error
    with PowerLog() as log:
        pass
    assert log.samples == [] and math.isnan(log.window(0, time.time())["power_w"])
