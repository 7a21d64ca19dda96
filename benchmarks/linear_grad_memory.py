"""Working memory of causal linear attention forward + backward against n:
the peak resident memory of one forward + backward call beyond its inputs,
output and gradients, each measurement in a fresh process (see memory.py
for how the peak is read and reset).

    python benchmarks/linear_grad_memory.py [--ns 1024,4096,16384] [--json FILE]

Shapes (1, 8, n, 64), float32, elu + 1 features. attnx writes its output
and gradients into arrays allocated (and touched) before the measurement,
so its figure is the kernels' own scratch. The pure-torch forms of
linear_grad.py allocate theirs during the call: their output and the three
gradients are subtracted, leaving what autograd saves and the
intermediates.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FORMS = ("attnx", "torch chunk-64 loop", "torch chunk-64 parallel", "torch cumsum")
CUMSUM_MAX = 4096


def measure(form, n, threads):
    """in the child: one warm-up call on a small shape, then the measured one"""
    sys.path.insert(0, HERE)
    from memory import proc_status_bytes, reset_peak

    def build(size):
        rng = np.random.default_rng(size)
        q, k, v, dout = (rng.standard_normal((1, 8, size, 64), dtype=np.float32) for _ in range(4))
        if form == "attnx":
            import attnx
            attnx.set_num_threads(threads)
            out, dq, dk, dv = (np.ones_like(x) for x in (v, q, k, v))  # touched

            def call():
                attnx.linear_attention(q, k, v, causal=True, out=out)
                attnx.linear_attention_backward(dout, q, k, v, causal=True, dq=dq, dk=dk, dv=dv)
            return call, 0
        from linear_grad import torch_call, torch_forms
        torch, forms = torch_forms()
        torch.set_num_threads(threads)
        return torch_call(torch, forms[form], q, k, v, dout), 4 * q.nbytes

    build(256)[0]()
    call, result_bytes = build(n)
    if not reset_peak():
        raise SystemExit("cannot reset the peak resident set (/proc/self/clear_refs)")
    before = proc_status_bytes("VmRSS")
    call()
    peak = proc_status_bytes("VmHWM")
    return {"form": form, "n": n, "extra_bytes": peak - before - result_bytes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="1024,2048,4096,8192,16384")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("FORM", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.threads)))
        return
    print(f"causal elu linear attention, forward + backward, (1, 8, n, 64) float32, "
          f"{args.threads} threads: peak memory beyond inputs, output and gradients (MiB)")
    ns = [int(x) for x in args.ns.split(",")]
    print(f"{'form':25s}" + "".join(f"{n:>10d}" for n in ns))
    results = []
    for form in FORMS:
        row = []
        for n in ns:
            if form == "torch cumsum" and n > CUMSUM_MAX:
                row.append("-")
                continue
            done = subprocess.run([sys.executable, __file__, "--child", form, str(n),
                                   "--threads", str(args.threads)],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                row.append("error")
                results.append({"form": form, "n": n, "error": done.stderr.strip()[-300:]})
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(result)
            row.append(f"{result['extra_bytes'] / 2**20:.2f}")
        print(f"{form:25s}" + "".join(f"{cell:>10s}" for cell in row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
