"""tools/memory_peak.py: the peak of a hand-made allocator trace and what is live there, against a brute-force replay."""

import pickle
import random

import pytest

from tools import memory_peak

TORCH = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}


def _frames(file: str, line: int, func: str, outer: str) -> list[dict]:
    """Innermost first: a torch frame, the caller, then the step phase's frame."""
    return [TORCH, {"filename": f"/work/{file}", "line": line, "name": func},
            {"filename": "/venv/megatron/core/pipeline_parallel/schedules.py", "line": 9, "name": outer}]  # fmt: skip


def _snapshot(rng: random.Random):
    """A trace of random allocations and frees over five sites, blocks live before it began, and the segments'
    state at its end; with the brute-force answer: peak bytes and bytes by site at the first peak."""
    sites = [("primus_fp8_plugin/ops/core.py", 10, "forward", "forward_step"),
             ("megatron/core/transformer/mlp.py", 20, "forward", "forward_step"),
             ("primus_fp8_plugin/ops/core.py", 30, "backward", "backward_step"),
             ("megatron/core/optimizer/distrib_optimizer.py", 40, "step", "train_step"),
             ("megatron/core/models/gpt/gpt_model.py", 50, "forward", "forward_step")]  # fmt: skip
    before = {0x1000 * (i + 1): rng.randrange(1, 50) * 512 for i in range(4)}  # live when the trace began
    live = {a: (s, None) for a, s in before.items()}
    events, addr = [], 0x100000
    best, best_live = sum(s for s, _ in live.values()), dict(live)
    for _ in range(300):
        if live and rng.random() < 0.45:
            a = rng.choice(sorted(live))
            size, _ = live.pop(a)
            events.append({"action": "free_requested", "addr": a, "size": size, "frames": []})
            events.append({"action": "free_completed", "addr": a, "size": size, "frames": []})
        else:
            addr += 0x10000
            size, k = rng.randrange(1, 200) * 512, rng.randrange(len(sites))
            live[addr] = (size, k)
            events.append({"action": "segment_alloc", "addr": addr, "size": size, "frames": []})
            events.append({"action": "alloc", "addr": addr, "size": size, "frames": _frames(*sites[k])})
        total = sum(s for s, _ in live.values())
        if total > best:
            best, best_live = total, dict(live)
    blocks = [{"address": a, "size": s + 512, "requested_size": s, "state": "active_allocated"} for a, (s, _) in live.items()]
    segments = [{"device": 0, "address": b["address"], "total_size": b["size"], "blocks": [b]} for b in blocks]
    segments.append({"device": 0, "address": 0x9000000, "total_size": 4096,
                     "blocks": [{"address": 0x9000000, "size": 4096, "requested_size": 0, "state": "inactive"}]})  # fmt: skip
    by_site = {}
    for size, k in best_live.values():
        name = "(before the trace)" if k is None else f"{sites[k][0]}:{sites[k][1]}({sites[k][2]})"
        by_site[name] = by_site.get(name, 0) + size
    return {"segments": segments, "device_traces": [events]}, best, by_site, sites


@pytest.mark.parametrize("seed, points", [(0, 2000), (1, 2000), (2, 7)])
def test_peak_and_live_sites_match_a_brute_force_replay(seed, points, monkeypatch):
    monkeypatch.setattr(memory_peak, "TIMELINE_POINTS", points)  # 7: windows of many events each
    snapshot, peak, by_site, sites = _snapshot(random.Random(seed))
    report = memory_peak.peak_report(snapshot, top=100)
    assert report["peak_bytes"] == peak
    assert {site: nbytes for site, _, nbytes, _ in report["by_site"]} == by_site
    assert sum(report["by_phase"].values()) == peak
    phase_of_site = {f"{f}:{line}({fn})": outer for f, line, fn, outer in sites}
    expected = {"forward_step": "forward", "backward_step": "backward", "train_step": "optimizer"}
    for site, phase, _, _ in report["by_site"]:
        if site != "(before the trace)":
            assert phase == expected[phase_of_site[site]]
    text = memory_peak.format_report(report)
    assert f"{peak / 2**20:,.1f} MiB" in text
    assert max(y for _, y in report["timeline"]) == peak  # each point keeps its window's maximum
    assert len(report["timeline"]) <= 2 * points
    assert [x for x, _ in report["timeline"]] == sorted({x for x, _ in report["timeline"]})


def test_a_trace_that_begins_after_frees_of_older_blocks_counts_them_from_the_end_state():
    """Blocks allocated before the trace and freed inside it: the start is what the end state and the trace imply."""
    f = _frames("primus_fp8_plugin/ops/core.py", 10, "forward", "forward_step")
    events = [{"action": "free_completed", "addr": 1, "size": 1000, "frames": []},
              {"action": "alloc", "addr": 2, "size": 300, "frames": f},
              {"action": "alloc", "addr": 3, "size": 200, "frames": f},
              {"action": "free_completed", "addr": 2, "size": 300, "frames": []}]  # fmt: skip
    segments = [{"device": 0, "address": a, "total_size": 4096,
                 "blocks": [{"address": a, "size": 4096, "requested_size": s, "state": "active_allocated"}]}
                for a, s in ((3, 200), (9, 5000))]  # fmt: skip
    report = memory_peak.peak_report({"segments": segments, "device_traces": [events]})
    assert report["start_bytes"] == 6000  # 5000 still live, 1000 freed first
    assert report["peak_bytes"] == 6000 and report["peak_event_index"] == -1
    assert report["end_bytes"] == 5200


def test_cli_reads_a_pickle_and_refuses_a_snapshot_without_a_trace(tmp_path, capsys):
    snapshot, peak, _, _ = _snapshot(random.Random(5))
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    assert memory_peak.main([str(path), "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 0
    assert f"{peak / 2**20:,.1f} MiB" in capsys.readouterr().out
    assert (tmp_path / "r.json").is_file()
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    assert memory_peak.main([str(path)]) == 2
    assert "_record_memory_history" in capsys.readouterr().err


def test_blocks_pending_free_count_as_live_and_a_full_trace_says_so():
    """A block freed while a stream still used it stays allocated (``active_pending_free``) until its
    ``free_completed``; a trace as long as the recording's limit is flagged: older events were dropped."""
    f = _frames("primus_fp8_plugin/ops/core.py", 10, "forward", "forward_step")
    events = [{"action": "alloc", "addr": 2, "size": 300, "frames": f},
              {"action": "free_requested", "addr": 2, "size": 300, "frames": []}]  # fmt: skip
    segments = [{"device": 0, "address": 2, "total_size": 4096,
                 "blocks": [{"address": 2, "size": 512, "requested_size": 300, "state": "active_pending_free"},
                            {"address": 514, "size": 3584, "requested_size": 0, "state": "inactive"}]}]  # fmt: skip
    report = memory_peak.peak_report({"segments": segments, "device_traces": [events]}, max_entries=2)
    assert report["start_bytes"] == 0 and report["peak_bytes"] == 300 and report["end_bytes"] == 300
    assert report["trace_full"] and "filled its buffer" in memory_peak.format_report(report)
    assert not memory_peak.peak_report({"segments": segments, "device_traces": [events]}, max_entries=3)["trace_full"]
