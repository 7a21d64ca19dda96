"""attnx beside torch with both held to one instruction set, in the same
interleaved rounds (harness.py): what a machine without AVX-512 gets.

    python benchmarks/isa_held.py --isa avx2|avx512|native [--threads 2] [--quick] [--only softmax|linear|decoding]
                                  [--json FILE]

`--isa avx2` runs the script again in an environment that holds both
libraries to AVX2+FMA (ISA_ENVIRONMENTS below): attnx by
ATTNX_DISABLE_CPU_FEATURES=AVX512F (every family then chooses its AVX2
kernels, or plain C + BLAS where it has none: docs/architecture.md) and
OPENBLAS_CORETYPE=Haswell (OpenBLAS's AVX2 kernels, for attnx and numpy), torch
by ATEN_CPU_CAPABILITY=avx2 (its own kernels), MKL_ENABLE_INSTRUCTIONS=AVX2
(MKL's) and DNNL_MAX_CPU_ISA=AVX2 (oneDNN's). `--isa avx512` holds both to
AVX-512 without AMX and avx512_bf16 (a VM that hides them: attnx by
ATTNX_DISABLE_CPU_FEATURES=AMX,AVX512_BF16, torch by ATEN_CPU_CAPABILITY=avx512,
MKL_ENABLE_INSTRUCTIONS=AVX512 and DNNL_MAX_CPU_ISA=AVX512_CORE). `--isa
native` leaves the environment as it is. The run prints what each library
chose.

Float32, shapes (1, 8, n, 64):
- softmax attention forward, and forward + backward (attnx.softmax_attention
  with return_lse=True, then softmax_attention_backward; torch's
  scaled_dot_product_attention, then torch.autograd.grad), n = 1024, 2048,
  4096, causal and not, with both FLOP rates (4 n m d a head for the
  forward's two products, 14 n m d for forward + backward's seven, over the
  visible pairs only when causal) as shares of the machine's float32
  multiply-add peak;
- causal linear attention (elu + 1) forward + backward at n = 4096: attnx
  (linear_attention, linear_attention_backward, into the same outputs every
  call) beside linear_grad.py's two torch chunk-64 formulations under
  autograd, with attnx's FLOP rate (3 x the forward's GEMM arithmetic,
  cases.py) as a share of the machine's float32 multiply-add peak in the
  widest vectors left in (benchmarks/machine_peak.c: AVX2 when
  ATTNX_DISABLE_CPU_FEATURES names AVX512F);
- softmax decoding, one query row per head against (1, 8, m, d) keys and
  values, m = 4096 with d = 64 and m = 16384 with d = 128 (one call per
  sample, as softmax_decode.py): also the bytes of K and V read per second,
  beside the read bandwidth harness.machine_peak measures on the same
  threads.
The fastest call of each (on a shared machine interference only slows a
call) and the ratio torch / attnx of the fastest calls (above 1: attnx is
faster) are printed, with the medians. Elementwise loops that GCC compiled
as target clones (csrc/vec_real.h, `ATTNX_HOT`) are chosen by the loader
from the CPU itself, which no variable moves: on an AVX-512 machine they
run their x86-64-v4 copies here (a build with clang has no clones).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ISA_ENVIRONMENTS = {
    "avx2": {"ATTNX_DISABLE_CPU_FEATURES": "AVX512F", "OPENBLAS_CORETYPE": "Haswell",
             "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "DNNL_MAX_CPU_ISA": "AVX2"},
    # the AVX-512 of a CPU whose VM hides AMX and avx512_bf16 (issue 34's
    # Intel kind), on a CPU that has them: float32 stays on AVX-512 FMAs
    "avx512": {"ATTNX_DISABLE_CPU_FEATURES": "AMX,AVX512_BF16", "OPENBLAS_CORETYPE": "SkylakeX",
               "ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "DNNL_MAX_CPU_ISA": "AVX512_CORE"},
    "native": {},
}
# set in the process run again with an ISA's environment
MARK = "ATTNX_BENCH_ISA"


def hold(isa):
    """Run this script again under isa's environment, unless this is that run."""
    if os.environ.get(MARK) == isa:
        return
    env = dict(os.environ, **ISA_ENVIRONMENTS[isa], **{MARK: isa})
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=sorted(ISA_ENVIRONMENTS), default="native")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 5 s budget per case")
    parser.add_argument("--only", choices=["softmax", "linear", "decoding"],
                        help="run only the softmax cases, the linear one or the decoding ones")
    parser.add_argument("--json", help="write the figures there")
    args = parser.parse_args()
    hold(args.isa)

    import numpy as np
    import torch
    import torch.nn.functional as F

    import attnx
    from cases import LINEAR_CHUNK, linear_chunk_flops_per_head
    from harness import Settings, machine_peak, measure
    from linear_grad import torch_forms

    attnx.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    settings = Settings(max_rounds=5, budget_s=5.0) if args.quick else Settings()
    variables = sorted({name for environment in ISA_ENVIRONMENTS.values() for name in environment})
    print(f"isa {args.isa}: " + ", ".join(f"{name}={os.environ.get(name, '')}" for name in variables))
    print(f"attnx {attnx.__version__}, {args.threads} threads: {attnx.cpu_dispatch()}, "
          f"OpenBLAS core {attnx._C.build_info()['blas_core']}")
    print(f"torch {torch.__version__}, {args.threads} threads: cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"load average before: {os.getloadavg()}")
    rows = []
    peak = machine_peak(args.threads)
    if peak is not None:
        print(peak.describe())

    def report(case, stats, attnx_name, torch_names):
        best = min(stats[name].min for name in torch_names)
        row = {"case": case, "attnx_min_ms": stats[attnx_name].min * 1e3,
               "attnx_median_ms": stats[attnx_name].median * 1e3,
               "torch_min_ms": best * 1e3, "torch_over_attnx": best / stats[attnx_name].min}
        for name in torch_names:
            row[f"{name} min_ms"] = stats[name].min * 1e3
            row[f"{name} median_ms"] = stats[name].median * 1e3
        rows.append(row)
        print(f"{case:42s} attnx {row['attnx_min_ms']:8.2f} ms (median "
              f"{row['attnx_median_ms']:.2f})  torch {row['torch_min_ms']:8.2f} ms  "
              f"torch/attnx {row['torch_over_attnx']:.2f}x", flush=True)

    def peak_shares(flops):
        """the last row's FLOP rates, attnx's and torch's, as shares of the peak"""
        row = rows[-1]
        for side in ("attnx", "torch"):
            row[f"{side}_gflops"] = flops / row[f"{side}_min_ms"] / 1e6
        if peak is not None:
            row["peak_gflops"] = peak.fma_f32_gflops
            print(f"{'':42s} attnx {row['attnx_gflops']:.0f} GFLOP/s "
                  f"({row['attnx_gflops'] / peak.fma_f32_gflops:.0%} of the peak), torch "
                  f"{row['torch_gflops']:.0f} ({row['torch_gflops'] / peak.fma_f32_gflops:.0%})",
                  flush=True)

    rng = np.random.default_rng(0)
    for n in (1024, 2048, 4096) if args.only in (None, "softmax") else ():
        for causal in (False, True):
            q, k, v, dout = (rng.standard_normal((1, 8, n, 64), dtype=np.float32)
                             for _ in range(4))
            tq, tk, tv, tdout = (torch.from_numpy(x) for x in (q, k, v, dout))
            tgrad = [x.clone().requires_grad_() for x in (tq, tk, tv)]
            name = f"softmax (1, 8, {n}, 64){' causal' if causal else ''}"

            def attnx_fwd():
                return attnx.softmax_attention(q, k, v, causal=causal)

            def torch_fwd():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            def attnx_step():
                out, lse = attnx.softmax_attention(q, k, v, causal=causal, return_lse=True)
                return attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=causal)

            def torch_step():
                out = F.scaled_dot_product_attention(*tgrad, is_causal=causal)
                return torch.autograd.grad(out, tgrad, tdout)

            stats, first, failed = measure({"attnx": attnx_fwd, "torch": torch_fwd}, settings)
            assert not failed, failed
            np.testing.assert_allclose(first["attnx"], first["torch"].numpy(), rtol=1e-3,
                                       atol=1e-4)
            report(name + " forward", stats, "attnx", ["torch"])
            visible_pairs = n * (n + 1) // 2 if causal else n * n
            peak_shares(8 * 4 * visible_pairs * 64)
            stats, first, failed = measure({"attnx": attnx_step, "torch": torch_step}, settings)
            assert not failed, failed
            for mine, theirs in zip(first["attnx"][:3], first["torch"]):
                np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-3, atol=1e-3)
            report(name + " forward + backward", stats, "attnx", ["torch"])
            peak_shares(8 * 14 * visible_pairs * 64)

    if args.only in (None, "linear"):
        _, forms = torch_forms()
        n = 4096
        q, k, v, dout = (rng.standard_normal((1, 8, n, 64), dtype=np.float32) for _ in range(4))
        out, dq, dk, dv = (np.empty_like(q) for _ in range(4))
        tgrad = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        tdout = torch.from_numpy(dout)

        def attnx_linear():
            attnx.linear_attention(q, k, v, causal=True, out=out)
            return attnx.linear_attention_backward(dout, q, k, v, causal=True, dq=dq, dk=dk, dv=dv)

        calls = {"attnx": attnx_linear}
        for form in ("torch chunk-64 loop", "torch chunk-64 parallel"):
            calls[form] = (lambda f: lambda: torch.autograd.grad(f(*tgrad), tgrad,
                                                                 tdout))(forms[form])
        stats, first, failed = measure(calls, settings)
        assert not failed, failed
        for form in calls:
            if form != "attnx":
                for mine, theirs in zip(first["attnx"][:3], first[form]):
                    np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-3, atol=1e-3)
        report(f"causal linear elu+1 (1, 8, {n}, 64) fwd + bwd", stats, "attnx",
               [form for form in calls if form != "attnx"])
        # the forward's GEMM arithmetic (cases.py) and the backward's, twice it
        flops = 3 * 8 * linear_chunk_flops_per_head(n, 64, 64, LINEAR_CHUNK)
        rows[-1]["attnx_gflops"] = flops / stats["attnx"].min / 1e9
        if peak is not None:
            rows[-1]["peak_gflops"] = peak.fma_f32_gflops
            print(f"  attnx {rows[-1]['attnx_gflops']:.1f} GFLOP/s (3 x the forward's GEMM "
                  f"FLOPs, cases.py), {rows[-1]['attnx_gflops'] / peak.fma_f32_gflops:.0%} of the "
                  f"{peak.describe()}", flush=True)
    if args.only in (None, "decoding"):
        # one query row per head against a KV cache (softmax_decode.c), memory
        # bound: the rate is the bytes of K and V read per second, beside the
        # read bandwidth measured on the same threads (harness.machine_peak)
        single = dict(min_sample_s=0.0, pause_s=0.02)
        decode_settings = (Settings(min_rounds=20, max_rounds=60, budget_s=3.0, **single)
                           if args.quick else
                           Settings(min_rounds=50, max_rounds=200, budget_s=10.0, **single))
        for heads, m, d in ((8, 4096, 64), (8, 16384, 128)):
            q = rng.standard_normal((1, heads, 1, d), dtype=np.float32)
            k, v = (rng.standard_normal((1, heads, m, d), dtype=np.float32) for _ in range(2))
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

            def attnx_decode():
                return attnx.softmax_attention(q, k, v)

            def torch_decode():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(tq, tk, tv)

            stats, first, failed = measure({"attnx": attnx_decode, "torch": torch_decode},
                                           decode_settings)
            assert not failed, failed
            np.testing.assert_allclose(first["attnx"], first["torch"].numpy(), rtol=1e-4,
                                       atol=1e-5)
            report(f"softmax decoding (1, {heads}, 1, {m}, {d})", stats, "attnx", ["torch"])
            rate = (k.nbytes + v.nbytes) / stats["attnx"].min
            rows[-1]["attnx_kv_gb_per_s"] = rate / 1e9
            rows[-1]["attnx_read_fraction"] = peak.read_fraction(rate) if peak else None
            print(f"{'':42s} attnx reads K, V at {rate / 1e9:.1f} GB/s"
                  + (f", {100 * peak.read_fraction(rate):.0f}% of the read bandwidth"
                     if peak else ""), flush=True)
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": args.isa, "threads": args.threads, "dispatch": attnx.cpu_dispatch(),
                       "torch_capability": torch.backends.cpu.get_cpu_capability(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
