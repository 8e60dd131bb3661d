"""benchmarks/kernel_profile.py on the CPU: kernel names by category, and a profiled step's busy share and
category times against a hand-made trace whose figures are worked out by hand below."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "benchmarks" / "kernel_profile.py")
kp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kp)

NAMES = {  # kernel names as the PyTorch profiler records them (CUDA, Triton, TE, cuDNN, NCCL) -> category
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel": "GEMM",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "GEMM",
    "grouped_gemm_kernel": "GEMM",
    "grouped_wgrad_kernel": "GEMM",
    "grouped_fwd_gluon_kernel": "GEMM",
    "blockwise_gemm_gluon_kernel": "GEMM",
    "cutlass3x_sm90_tensorop_gemm_f8_f8_f32_bf16_128x128x128": "GEMM",
    "quantize_grouped_1x128_kernel": "quantization",
    "quantize_fused_gluon_kernel": "quantization",
    "void transformer_engine::detail::cast_transpose_kernel<...>": "quantization",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<...>": "permutation",
    "void at::native::index_elementwise_kernel<128, 4, ...>": "permutation",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>": "permutation",
    "void transformer_engine::moe_permute_kernel<...>": "permutation",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>, ...>": "elementwise",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "elementwise",
    "void at::native::reduce_kernel<512, 1, ...>": "elementwise",
    "swiglu_bwd_kernel": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
    "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda(c10::BFloat16)#1}, ...>": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}::operator()() const::{lambda(float)#1}, ...>": "elementwise",
    "void lamb_stage1_kernel<float>(...)": "optimizer",
    "rope_kernel": "elementwise",
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, ...>": "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "some_kernel_nobody_knows": "other",
}


@pytest.mark.parametrize("name, category", NAMES.items(), ids=[n[:40] for n in NAMES])
def test_kernel_names_fall_into_their_categories(name, category):
    assert kp.kernel_category(name) == category


def kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream, "pid": 0}


def hand_made_trace() -> list[dict]:
    """Step 5 spans 1000..11000 us on the CPU; kernels (us): two overlapping GEMMs on two streams, a
    quantization, an add, a flash kernel, a kernel before the step (left out), an NCCL kernel that starts inside
    and ends after the CPU span (it extends the step to 12000), one after (left out); an earlier step 4."""
    return [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": -5000, "dur": 4000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 1000, "dur": 10000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1200, "dur": 50},
        kernel("grouped_gemm_kernel", 1000, 2000),
        kernel("sm90_xmma_gemm_bf16", 2500, 1500, stream=20),
        kernel("quantize_grouped_1x128_kernel", 5000, 500),
        kernel("vectorized_elementwise_kernel<add>", 6000, 100),
        kernel("flash_fwd_kernel", 7000, 2000),
        kernel("ncclDevKernel_AllReduce", 10500, 1500),
        kernel("grouped_gemm_kernel", 0, 500),
        kernel("grouped_gemm_kernel", 12500, 500),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 4500, "dur": 300},
    ]


def test_step_profile_against_the_hand_worked_figures():
    s = kp.step_profile(hand_made_trace())
    # busy: [1000, 4000] (the GEMMs' union) + 500 + 100 + 2000 + 1500 = 7100 us over 1000..12000 = 11000 us
    assert s["step"] == 5 and s["kernels"] == 6
    assert s["step_ms"] == pytest.approx(11.0) and s["busy_ms"] == pytest.approx(7.1)
    assert s["busy_share"] == pytest.approx(7100 / 11000)
    cats = {c: (v["ms"], v["kernels"]) for c, v in s["by_category"].items() if v["kernels"]}
    want = {"GEMM": (3.5, 2), "quantization": (0.5, 1), "elementwise": (0.1, 1), "attention": (2.0, 1),
            "communication": (1.5, 1)}  # fmt: skip
    assert cats.keys() == want.keys()
    assert all(cats[c][0] == pytest.approx(want[c][0]) and cats[c][1] == want[c][1] for c in want), cats
    text = kp.format_profile(s)
    assert text.splitlines()[0] == "step 5: 11.0 ms, GPU busy 64.5% (7.1 ms, 6 kernels)"
    assert text.splitlines()[1].split()[:2] == ["GEMM", "3.50"]  # the largest category first


def test_traces_are_found_and_read_gzipped(tmp_path):
    path = tmp_path / "torch_profile" / "rank-0.json.gz"
    path.parent.mkdir()
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": hand_made_trace()}, f)
    assert kp.find_trace(tmp_path) == path
    assert kp.step_profile(kp.load_trace(path))["busy_ms"] == pytest.approx(7.1)
    assert kp.find_trace(tmp_path / "torch_profile" / "none") is None
    with pytest.raises(ValueError, match="no ProfilerStep"):
        kp.step_profile([kernel("grouped_gemm_kernel", 0, 10)])


def host(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_idle_gaps_are_charged_to_what_the_launching_thread_was_doing():
    """Step 5 on thread 1 spans 0..10000 us; kernels at 500-1000 and 2950-3100 (launched by thread 1) and 8500-9500
    (by thread 2, the autograd thread). Gaps: 0-500 (thread 1 in train_step), 1000-2950 (middle 1975: thread 1 waits
    in a cudaStreamSynchronize inside aten::nonzero inside forward), 3100-8500 (middle 5800: thread 2 in
    aten::index_add_ inside backward), 9500-10000 after the last kernel (the step's thread: train_step)."""
    events = [
        host("user_annotation", "ProfilerStep#5", 0, 10000, 1),
        host("python_function", "train.py(10): train_step", 0, 10000, 1),
        host("python_function", "moe_layer.py(50): forward", 1000, 3000, 1),
        host("cpu_op", "aten::nonzero", 1500, 1400, 1),
        host("cuda_runtime", "cudaStreamSynchronize", 1900, 900, 1),
        host("cuda_runtime", "cudaLaunchKernel", 450, 10, 1, correlation=1),
        host("cuda_runtime", "cudaLaunchKernel", 2920, 10, 1, correlation=2),
        host("python_function", "engine.py(7): backward", 5000, 4000, 2),
        host("cpu_op", "aten::index_add_", 5500, 2500, 2),
        host("cuda_runtime", "cudaLaunchKernel", 8400, 10, 2, correlation=3),
        {**kernel("grouped_gemm_kernel", 500, 500), "args": {"correlation": 1}},
        {**kernel("quantize_grouped_1x128_kernel", 2950, 150), "args": {"correlation": 2}},
        {**kernel("unpermute_kernel", 8500, 1000), "args": {"correlation": 3}},
    ]
    s = kp.step_profile(events)
    assert s["busy_ms"] == pytest.approx(1.65) and s["step_ms"] == pytest.approx(10.0)
    got = {i["chain"]: (round(i["idle_ms"], 6), i["gaps"]) for i in s["idle_by_host_frame"]}
    assert got == {
        "engine.py(7): backward > aten::index_add_": (5.4, 1),
        "train.py(10): train_step > moe_layer.py(50): forward > cudaStreamSynchronize": (1.95, 1),
        "train.py(10): train_step": (1.0, 2),
    }
    assert [round(i["idle_ms"], 6) for i in s["idle_by_host_frame"]] == [5.4, 1.95, 1.0]  # largest first
    text = kp.format_profile(s).splitlines()
    assert text[-4].startswith("  GPU idle 8.") and text[-3].split()[:3] == ["5.40", "ms", "1"]


def test_kernels_by_name_and_two_steps_compared(tmp_path, capsys):
    """The hand-made step's names counted; a second step with two more adds and no flash kernel: the comparison
    names exactly those two differences, the larger first."""
    s = kp.step_profile(hand_made_trace(), top_names=0)
    names = {k["name"]: (k["count"], round(k["ms"], 6)) for k in s["top_kernels"]}
    assert names == {"grouped_gemm_kernel": (1, 2.0), "sm90_xmma_gemm_bf16": (1, 1.5), "quantize_grouped_1x128_kernel": (1, 0.5),
                     "vectorized_elementwise_kernel<add>": (1, 0.1), "flash_fwd_kernel": (1, 2.0),
                     "ncclDevKernel_AllReduce": (1, 1.5)}  # fmt: skip
    other = [e for e in hand_made_trace() if e.get("name") != "flash_fwd_kernel"]
    other += [kernel("vectorized_elementwise_kernel<add>", 9200 + 100 * i, 50) for i in range(2)]
    b = kp.step_profile(other, top_names=0)
    rows = kp.compare_kernels(s, b)
    assert [(r["name"], r["a"], r["b"], r["diff"]) for r in rows] == [
        ("vectorized_elementwise_kernel<add>", 1, 3, 2), ("flash_fwd_kernel", 1, 0, -1)]  # fmt: skip
    assert rows[0]["ms_diff"] == pytest.approx(0.1) and rows[1]["ms_diff"] == pytest.approx(-2.0)
    assert kp.compare_kernels(s, s) == []
    paths = []
    for i, events in enumerate((hand_made_trace(), other)):
        paths.append(tmp_path / f"t{i}.json")
        paths[-1].write_text(json.dumps({"traceEvents": events}))
    assert kp.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "most launched kernels" in out and "     1 ->      3      +2" in out
