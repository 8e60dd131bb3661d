"""Experiment: persistent, cp.async-pipelined quantizers vs the committed ones (bit-exact + timing)."""

import itertools
import sys
import time

import torch
import triton

sys.path.insert(0, "scripts")
from benchlib import bench_ms
from exp_persist_kernels import act_persist_kernel, weight_persist_kernel

from primus_fp8_plugin import BlockwiseRecipe, TensorRole
from primus_fp8_plugin.backends.triton.quantize_act import dual_outputs, quantize_1x128_dual
from primus_fp8_plugin.backends.triton.quantize_weight import quantize_128x128
from primus_fp8_plugin.tensor import ceil_div, pad4, scale_inv_shape

recipe = BlockwiseRecipe()
P_ACT, P_W = recipe.params(TensorRole.INPUT), recipe.params(TensorRole.WEIGHT)
P_GRAD = BlockwiseRecipe(fp8_format="HYBRID").params(TensorRole.GRAD_OUTPUT)
NSM = torch.cuda.get_device_properties(0).multi_processor_count


def act_new(x, p, stages, warps, cps, even):
    m, k = x.shape
    row_q, row_s, col_q, col_s, _ = dual_outputs(x, p, True, True)
    nt = ceil_div(m, 128) * ceil_div(k, 128)
    grid = (min(nt, NSM * cps),)
    act_persist_kernel[grid](
        x,
        row_q,
        row_s,
        col_q,
        col_s,
        m,
        k,
        pad4(m),
        pad4(k),
        x.stride(0),
        p.fp8_max,
        p.amax_epsilon,
        torch.finfo(x.dtype).max,
        nt,
        ceil_div(k, 128),
        True,
        True,
        p.pow2_scales,
        128,
        stages,
        even,
        num_warps=warps,
        num_stages=stages,
    )
    return row_q, row_s, col_q, col_s


def w_new(w, p, stages, warps, cps, even, one):
    n, k = w.shape
    q = torch.empty(n, k, dtype=p.fp8_dtype, device=w.device)
    qt = torch.empty(k, n, dtype=p.fp8_dtype, device=w.device)
    s = torch.ones(scale_inv_shape(n, k, 2), dtype=torch.float32, device=w.device)
    st = torch.ones(scale_inv_shape(k, n, 2), dtype=torch.float32, device=w.device)
    nt = ceil_div(n, 128) * ceil_div(k, 128)
    grid = (min(nt, NSM * cps),)
    weight_persist_kernel[grid](
        w,
        q,
        qt,
        s,
        st,
        n,
        k,
        w.stride(0),
        s.stride(0),
        st.stride(0),
        p.fp8_max,
        p.amax_epsilon,
        torch.finfo(w.dtype).max,
        nt,
        ceil_div(k, 128),
        p.pow2_scales,
        128,
        stages,
        even,
        one,
        num_warps=warps,
        num_stages=stages,
    )
    return q, s, qt, st


def same(a, b):
    if a.dtype.is_floating_point and a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


ACT = [(2, 8, 1), (3, 8, 1), (2, 16, 1), (4, 16, 1), (2, 4, 2)]
WGT = [(2, 8, 2, 0), (3, 8, 1, 0), (2, 8, 1, 1), (2, 16, 1, 0), (4, 16, 1, 0)]


def check():
    bad = 0
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(256, 256), (384, 1280), (1024, 4096), (8192, 8192), (4096, 14336), (200, 272), (1000, 2000), (16, 16)]
    for (m, k), (dt, p) in itertools.product(shapes, [(torch.bfloat16, P_ACT), (torch.bfloat16, P_GRAD), (torch.float32, P_ACT)]):
        x = (torch.randn(m, k, device="cuda", generator=g) * torch.exp(3 * torch.randn(m, 1, device="cuda", generator=g))).to(dt)
        if m >= 256 and k >= 256:
            x[130, 7] = float("nan")
            x[5, 200] = float("inf")
            x[140:150, 130:140] = 0
        even = m % 128 == 0 and k % 128 == 0
        ref = quantize_1x128_dual(x.contiguous(), p, rowwise=True, columnwise=True)
        refs = (ref.rowwise_data, ref.rowwise_scale_inv, ref.columnwise_data, ref.columnwise_scale_inv)
        for (s, w, c), ev in itertools.product(ACT, sorted({even, False})):
            out = act_new(x, p, s, w, c, ev)
            ok = all(same(a, b) for a, b in zip(out, refs))
            if not ok:
                bad += 1
                print(f"ACT MISMATCH {m}x{k} {dt} {p.fp8_dtype} s{s} w{w} c{c} even{ev}", [same(a, b) for a, b in zip(out, refs)])
        if p is P_ACT:  # weights: bf16 and fp32
            rw = quantize_128x128(x, P_W)
            refw = (rw.rowwise_data, rw.rowwise_scale_inv, rw.columnwise_data, rw.columnwise_scale_inv)
            for (s, w, c, one), ev in itertools.product(WGT, sorted({even, False})):
                try:
                    out = w_new(x, P_W, s, w, c, ev, one)
                except triton.runtime.errors.OutOfResources:
                    continue
                oks = [same(a, b) for a, b in zip(out, refw)]
                if not all(oks):
                    bad += 1
                    print(f"W MISMATCH {m}x{k} {dt} s{s} w{w} c{c} one{one} even{ev}", oks)
    print(f"correctness: {bad} mismatching variant-cases", flush=True)


def timing():
    for m, k in [(8192, 8192), (16384, 4096), (8192, 29568), (4096, 14336)]:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(x)
        hp = x.numel() * 2
        abytes = hp + 2 * x.numel() + 4 * (m * ceil_div(k, 128) + k * ceil_div(m, 128))
        wbytes = hp + 2 * x.numel() + 8 * ceil_div(m, 128) * ceil_div(k, 128)
        cands = {
            "copy": (lambda: dst.copy_(x), 2 * hp),
            "act now": (lambda: quantize_1x128_dual(x, P_ACT, rowwise=True, columnwise=True), abytes),
            "w now": (lambda: quantize_128x128(x, P_W), wbytes),
        }
        for s, w, c in ACT:
            cands[f"act s{s} w{w} c{c} even"] = ((lambda s=s, w=w, c=c: act_new(x, P_ACT, s, w, c, True)), abytes)
        for s, w, c in ACT[:3]:
            cands[f"act s{s} w{w} c{c} masked"] = ((lambda s=s, w=w, c=c: act_new(x, P_ACT, s, w, c, False)), abytes)
        for s, w, c, one in WGT:
            cands[f"w s{s} w{w} c{c} one{one} even"] = (
                (lambda s=s, w=w, c=c, one=one: w_new(x, P_W, s, w, c, True, one)),
                wbytes,
            )
        for fn, _ in cands.values():
            fn()
        torch.cuda.synchronize()
        res = {key: [] for key in cands}
        for _ in range(3):  # interleaved repeats
            for key, (fn, _) in cands.items():
                res[key].append(bench_ms(fn, 20, 80))
        tcopy = sorted(res["copy"])[1]
        cbw = 2 * hp / tcopy / 1e9
        print(f"--- {m}x{k}: copy {tcopy * 1e3:.1f} us = {cbw:.2f} TB/s")
        for key, (fn, nb) in cands.items():
            t = sorted(res[key])[1]
            print(f"{key:32} {t * 1e3:8.1f} us  {100 * nb / t / 1e9 / cbw:5.1f}% of copy")
        sys.stdout.flush()


if __name__ == "__main__":
    t0 = time.time()
    check()
    print(f"check {time.time() - t0:.0f}s", flush=True)
    timing()
    print(f"total {time.time() - t0:.0f}s")
