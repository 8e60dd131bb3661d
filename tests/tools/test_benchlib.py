"""benchmarks/benchlib.PowerLog: parses nvidia-smi's CSV samples and summarises a time window (CPU, with a
stand-in nvidia-smi on PATH)."""

import json
import os
import stat
import time
import types
from pathlib import Path

import pytest

from benchmarks import benchlib
from benchmarks.benchlib import PowerLog, Timing, report

# Without -lms: one line and exit (PowerLog's field probes). With -lms: one sample every 20 ms
# (clock 1400 + i, power 690 + i) stamped with the local time, as nvidia-smi does, after a line
# PowerLog must skip; it records the fields it was asked for.
FAKE_SMI = """#!/usr/bin/env python3
import datetime, os, sys, time
args = " ".join(sys.argv[1:])
open(sys.argv[0] + ".args", "a").write(args + "\\n")
if "-lms" not in args:
    print("ok")
    sys.exit(0)
if os.environ.get("FAKE_SMI_GARBAGE"):
    print("Field 'power.draw.instant' is not a valid field to query.", flush=True)
    sys.exit(2)
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


def test_power_log_says_when_it_reads_nothing(fake_smi, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SMI_GARBAGE", "1")
    with PowerLog(interval_ms=20) as log:
        time.sleep(0.1)
    assert log.samples == []
    assert "no readable nvidia-smi sample" in capsys.readouterr().err


def test_timing_default_is_do_bench(monkeypatch):
    monkeypatch.setattr(benchlib, "bench_ms", lambda fn: (fn(), 2.5)[1])
    calls, row = [], {}
    with Timing() as timing:
        assert timing.ms(lambda: calls.append(1), row, "ours") == 2.5
        assert timing.order(["a", "b"], 1) == ["a", "b"]  # no reordering outside sustained runs
    assert calls == [1] and row == {} and "do_bench" in timing.describe()


def test_timing_sustained_writes_clock_and_power_into_the_rows(fake_smi, monkeypatch):
    def fake_sustained(fn, seconds):
        t0 = time.time()
        fn()
        time.sleep(seconds)
        return 4.0, t0, time.time()

    monkeypatch.setattr(benchlib, "sustained_ms", fake_sustained)
    rows = [{"shape": "a"}, {"shape": "b"}]
    with Timing(0.3) as timing:
        assert timing.order(["x", "y", "z"], 0) == ["x", "y", "z"]
        assert timing.order(["x", "y", "z"], 1) == ["z", "y", "x"]  # every other group reversed
        assert timing.ms(lambda: None, rows[0], "ours") == 4.0
        assert timing.ms(lambda: None, rows[1], "step") == 4.0
        assert timing.ms(lambda: None) == 4.0  # timed, recorded nowhere
    assert rows[0]["ours MHz"] >= 1400 and rows[0]["ours W"] - rows[0]["ours MHz"] == pytest.approx(-709.5)
    assert rows[1]["step throttle"] == "0x0000000000000004"
    assert rows[1]["step MHz"] > rows[0]["ours MHz"]  # its own window: later samples, higher fake clocks
    assert "sustained 0.3 s" in timing.describe()


def test_report_prints_the_table_and_notes_and_writes_json_and_plot(tmp_path, capsys):
    plotted = []
    args = types.SimpleNamespace(json=str(tmp_path / "out.json"), plot=str(tmp_path / "out.png"))
    rows = [{"shape": "8x8", "TF": 12.34}, {"shape": "16x8"}]
    report("bench_x", {"gpu": "G"}, rows, [("shape", ""), ("TF", ".1f")], args, lambda r, p: plotted.append((r, p)),
           ["a note"], summary={"fwd": 1.0})  # fmt: skip
    out = capsys.readouterr().out
    assert "# bench_x  {'gpu': 'G'}" in out and "12.3" in out and "-" in out and "a note" in out
    assert json.loads((tmp_path / "out.json").read_text()) == {"env": {"gpu": "G"}, "rows": rows, "summary": {"fwd": 1.0}}
    assert plotted == [(rows, str(tmp_path / "out.png"))]


def test_step_peak_mib_is_the_peak_above_the_start(monkeypatch):
    """step_peak_mib: ``before`` runs unmeasured, then the step's peak allocation above the allocation at its start
    (a stand-in allocator: CPU only)."""
    import torch

    state = {"now": 0, "peak": 0}

    def alloc(nbytes):
        state["now"] += nbytes
        state["peak"] = max(state["peak"], state["now"])

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["now"]))
    alloc(100 * 2**20)  # the model, before the step
    alloc(50 * 2**20)  # last step's gradients, dropped by ``before``

    def step():
        alloc(30 * 2**20)
        alloc(20 * 2**20)
        alloc(-40 * 2**20)

    assert benchlib.step_peak_mib(step, lambda: alloc(-50 * 2**20)) == 50.0
    assert benchlib.step_peak_mib(step) == 50.0  # from 110 MiB to a peak of 160 MiB
