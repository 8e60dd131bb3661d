"""Scratch experiment: persistent TMA-ring quantizers and maxnreg variants vs the committed Gluon kernels."""
import statistics, sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from benchlib import graph_ms, bench_ms
from primus_fp8_plugin.recipe import QuantParams
from primus_fp8_plugin.backends.triton import quantize_act_gluon as qag, quantize_weight_gluon as qwg
from primus_fp8_plugin.backends.triton.quantize_gluon_tiles import transpose_tile_layouts
from primus_fp8_plugin.backends.triton.quantize_act import dual_outputs
from primus_fp8_plugin.backends.triton.launch import FastLauncher
from primus_fp8_plugin.tensor import BlockwiseFp8Tensor, ceil_div, pad4, scale_inv_shape
import act_variants

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
_act_launch = FastLauncher(act_variants.act_kernel)


def act_prod_opts(x, params, rowwise=True, columnwise=True, **opts):
    m, k = x.shape
    row_q, row_s, col_q, col_s, parts = dual_outputs(x, params, rowwise, columnwise)
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    q_any = row_q if row_q is not None else col_q
    s_any = row_s if row_s is not None else col_s
    _act_launch((ceil_div(m, 128), ceil_div(k, 128)), x, row_q if rowwise else q_any, row_s if rowwise else s_any,
                col_q if columnwise else q_any, col_s if columnwise else s_any, m, k, pad4(m), pad4(k),
                params.fp8_max, params.amax_epsilon, torch.finfo(x.dtype).max, rowwise, columnwise, params.pow2_scales,
                lay, lay_n, lay_t, t_smem, False, num_warps=8, **opts)
    return BlockwiseFp8Tensor((m, k), 1, params.fp8_dtype, x.dtype, **parts)


def weight_prod_opts(w, params, **opts):
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev); qt = torch.empty(k, n, dtype=f8, device=dev)
    s = torch.empty(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.empty(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    lay, lay_n, lay_t, t_smem = transpose_tile_layouts()
    qwg._launch((ceil_div(n, 128) * ceil_div(k, 128),), w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
                params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max, ceil_div(n, 128), params.pow2_scales,
                lay, lay_n, lay_t, t_smem, num_warps=8, **opts)
    return BlockwiseFp8Tensor((n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st)


import weight_v2
ACT = {
    "prod": lambda x, p, r=True, c=True: qag.quantize_1x128_dual_gluon(x, p, rowwise=r, columnwise=c),
}
WEIGHT = {
    "prod": qwg.quantize_128x128_gluon,
    "row_first": lambda w, p: weight_v2.quantize_weight_v2(w, p, "4x16", True, group=1 << 20),
    "g4": lambda w, p: weight_v2.quantize_weight_v2(w, p, "4x16", True, group=4),
    "g8": lambda w, p: weight_v2.quantize_weight_v2(w, p, "4x16", True, group=8),
    "g16": lambda w, p: weight_v2.quantize_weight_v2(w, p, "4x16", True, group=16),
    "8x8_ob": lambda w, p: weight_v2.quantize_weight_v2(w, p, "8x8", True),
}
PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def same(a, b):
    for part in PARTS:
        x, y = getattr(a, part), getattr(b, part)
        if (x is None) != (y is None):
            return f"{part} presence"
        if x is None:
            continue
        ix = x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int32)
        iy = y.view(torch.uint8) if y.element_size() == 1 else y.view(torch.int32)
        d = ix != iy
        if x.dtype == torch.float32:
            d &= ~(torch.isnan(x) & torch.isnan(y))
        if int(d.sum()):
            return f"{part}: {int(d.sum())} differ"
    return None


def make(m, k, dt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
    if m > 4 and k > 4:
        x[0] = 0; x[1, :min(k, 128)] = 1e-30; x[m // 2, k // 2] = float("nan"); x[m - 1, k - 1] = float("inf")
    return x.to(dt)


def check():
    bad = 0
    cases = [(144, 400, torch.bfloat16, E4, True), (4096, 4096, torch.bfloat16, E4, True), (1008, 1552, torch.bfloat16, E5, False),
             (208, 144, torch.float16, E4, True), (16, 16, torch.bfloat16, E4, True), (2064, 1040, torch.float16, E4, False),
             (8192, 2048, torch.bfloat16, E4, True), (144, 384, torch.float32, E4, True), (1024, 1536, torch.float32, E5, False)]
    for i, (m, k, dt, f8, pow2) in enumerate(cases):
        x = make(m, k, dt, i)
        pa = QuantParams(f8, 1, pow2_scales=pow2)
        pw = QuantParams(f8, 2, pow2_scales=pow2)
        for rc in ((True, True), (True, False), (False, True)):
            ref = ACT["prod"](x, pa, *rc)
            for name, fn in ACT.items():
                if name == "prod" or (dt == torch.float32 and name in ("tma_s4c1",)):
                    continue
                try:
                    why = same(fn(x, pa, *rc), ref)
                except Exception as e:
                    why = f"raised {type(e).__name__}: {str(e)[:200]}"
                if why:
                    bad += 1; print(f"ACT MISMATCH {name} {m}x{k} {dt} {rc}: {why}")
        ref = WEIGHT["prod"](x, pw)
        for name, fn in WEIGHT.items():
            if name == "prod" or (dt == torch.float32 and name in ("tma_s4c1",)):
                continue
            try:
                why = same(fn(x, pw), ref)
            except Exception as e:
                why = f"raised {type(e).__name__}: {str(e)[:200]}"
            if why:
                bad += 1; print(f"WEIGHT MISMATCH {name} {m}x{k} {dt}: {why}")
    torch.cuda.synchronize()
    print(f"check: {len(cases)} cases, {bad} mismatches", flush=True)
    return bad


def bench(rounds, timer_name):
    timer = graph_ms if timer_name == "graph" else bench_ms
    for m, k in ((8192, 8192), (16384, 4096), (8192, 29568), (4096, 14336)):
        w = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(w)
        pa, pw = QuantParams(E4, 1), QuantParams(E4, 2)
        fns = {f"act_{n}": (lambda f=f: f(w, pa)) for n, f in ACT.items()}
        fns.update({f"w_{n}": (lambda f=f: f(w, pw)) for n, f in WEIGHT.items()})
        pct = {n: [] for n in fns}
        for _ in range(rounds):
            c = timer(lambda: dst.copy_(w))
            for n, f in fns.items():
                pct[n].append(100 * c / timer(f))
        print(f"{timer_name} {m}x{k} copy={1e3*c:.1f}us: " + "  ".join(f"{n} {statistics.median(p):.1f}[{min(p):.0f}-{max(p):.0f}]" for n, p in pct.items()), flush=True)


if __name__ == "__main__":
    bad = check()
    bench(int(sys.argv[1]) if len(sys.argv) > 1 else 3, "graph")
    bench(1, "do_bench")
    sys.exit(1 if bad else 0)
