"""scripts/benchlib.PowerLog: parses nvidia-smi's CSV samples and summarises a time window (CPU, with a
stand-in nvidia-smi on PATH)."""

import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from benchlib import PowerLog  # noqa: E402

# Without -lms: one line and exit (PowerLog's field probes). With -lms: one sample every 20 ms
# (clock 1400 + i, power 690 + i) stamped with the local time, as nvidia-smi does, after a line
# PowerLog must skip; it records the fields it was asked for.
FAKE_SMI = """#!/usr/bin/env python3
import datetime, sys, time
args = " ".join(sys.argv[1:])
open(sys.argv[0] + ".args", "a").write(args + "\\n")
if "-lms" not in args:
    print("ok")
    sys.exit(0)
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
    return exe


@pytest.fixture(params=["UTC", "Asia/Kolkata"])
def local_tz(request, monkeypatch):
    """nvidia-smi stamps local time and PowerLog compares with time.time(): both zones must agree."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()


def test_power_log_window(fake_smi, local_tz):
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
    inside = [s for s in log.samples if t0 <= s[0] <= t1]
    assert 15 <= len(inside) <= 30  # ~25 samples of 20 ms: the time stamps line up with time.time()
    assert w["sm_mhz"] == pytest.approx(sorted(s[1] for s in inside)[len(inside) // 2], abs=1)
    assert w["power_w"] - w["sm_mhz"] == pytest.approx(-709.5)  # power 690.5 + i against clock 1400 + i
    assert w["temp_c"] == 60 and w["throttle"] == "0x0000000000000004"
    assert log.window(t1 + 100, t1 + 200)["sm_mhz"] is None
    sampled = [a for a in Path(f"{fake_smi}.args").read_text().splitlines() if "-lms" in a]
    assert len(sampled) == 1 and "power.draw.instant" in sampled[0]  # the probe said it is supported


def test_power_log_without_nvidia_smi(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to run: records nothing, says so, no exception
    with PowerLog() as log:
        pass
    assert log.samples == [] and log.window(0, time.time())["power_w"] is None
    assert "cannot run nvidia-smi" in capsys.readouterr().err
