"""attnx benchmark suite: attnx beside numpy, PyTorch and an OpenBLAS gemm,
all measured in one run on this machine.

    python benchmarks/run.py [--quick] [--out DIR] [--peers-only]

Prints a machine line, a table per variant, the design targets (PASS/MISS)
and writes bench-<mode>.json, .png and .txt to DIR (benchmarks/results/).
"""
import argparse
import dataclasses
import functools
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cases  # noqa: E402
import harness  # noqa: E402
import memory  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

SETTINGS = {
    "full": harness.Settings(min_rounds=5, max_rounds=11, budget_s=15.0, warmup_s=0.2),
    "quick": harness.Settings(min_rounds=3, max_rounds=5, budget_s=4.0, warmup_s=0.1),
}
TOLERANCE = {"float32": 2e-3, "float64": 1e-8}     # max |diff| / max |reference|
BUSY_CORES = 0.25       # cores kept busy by other processes above which we warn
PEAK = None             # the machine's ceilings (harness.machine_peak), measured by main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset with fewer rounds (< 2 min)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="output directory")
    parser.add_argument("--peers-only", action="store_true", help="run without attnx")
    parser.add_argument("--only", default="", help="only cases whose label contains this text")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads for attnx, torch and numpy's BLAS (default: usable cores)")
    return parser.parse_args()


def import_attnx(peers_only):
    if peers_only:
        return None
    try:
        return cases.load_attnx()
    except ImportError as error:
        sys.exit("attnx is not importable (%s).\nBuild it (python setup.py build_ext --inplace, "
                 "or pip install .), or run the peers alone with --peers-only." % error)


# ------------------------------------------------------------ machine

def set_threads(threads, attnx):
    peers.torch_module().set_num_threads(threads)
    if attnx is not None:
        attnx.set_num_threads(threads)
    numpy_blas = numpy_blas_controller()
    if numpy_blas is not None:
        numpy_blas.set_num_threads(threads)


def numpy_blas_controller():
    """threadpoolctl's handle on numpy's own BLAS (never attnx's bundled one,
    which attnx keeps single-threaded), or None without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    found = [lib for lib in ThreadpoolController().lib_controllers
             if lib.user_api == "blas" and os.sep + "numpy" in lib.filepath]
    return found[0] if found else None


def busy_cores(seconds=0.5):
    """Cores kept busy by other processes (this one sleeps meanwhile), from
    two readings of /proc/stat; None where it does not exist."""
    def busy_and_total():
        with open("/proc/stat") as stat:
            ticks = [int(t) for t in stat.readline().split()[1:]]
        idle = ticks[3] + ticks[4]                   # idle + iowait
        return sum(ticks) - idle, sum(ticks)
    try:
        busy_before, total_before = busy_and_total()
        time.sleep(seconds)
        busy_after, total_after = busy_and_total()
    except OSError:
        return None
    cores = os.cpu_count() or 1
    return cores * (busy_after - busy_before) / max(total_after - total_before, 1)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(attnx):
    torch = peers.torch_module()
    numpy_blas = numpy_blas_controller()
    build = attnx._C.build_info() if attnx is not None and hasattr(attnx._C, "build_info") else {}
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
        "attnx": getattr(attnx, "__version__", None), "attnx_blas": build.get("blas"),
        "attnx_simd": build.get("simd"), "attnx_amx": build.get("amx"),
        "threads": {"attnx": attnx.get_num_threads() if attnx is not None else None,
                    "torch": torch.get_num_threads(),
                    "numpy_blas": numpy_blas.num_threads if numpy_blas is not None else None},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_1min_at_start": os.getloadavg()[0],
        "busy_cores_at_start": busy_cores(),
    }


def machine_line(info):
    attnx = "attnx %s" % info["attnx"] if info["attnx"] else "attnx not loaded"
    if info["attnx_blas"]:
        attnx += " (%s, %s%s)" % (info["attnx_blas"], info["attnx_simd"],
                                  ", AMX for float32 softmax" if info.get("attnx_amx") else "")
    threads = ", ".join("%s %s" % (name, "?" if count is None else count)
                        for name, count in info["threads"].items())
    busy = info["busy_cores_at_start"]
    return ("machine: %s, %d cores (%d usable), %s cores busy with other work | %s, numpy %s, "
            "torch %s, python %s | threads: %s" % (
                info["cpu"], info["cores"], info["usable_cores"], "?" if busy is None else "%.2f" % busy,
                attnx, info["numpy"], info["torch"], info["python"], threads))


# ------------------------------------------------------------ one case

def competitor_plan(case, attnx, args):
    """({name: reason} skipped, [names] to run) for a case."""
    skipped, names = {}, []
    for name in cases.COMPETITORS[case.kind]:
        is_attnx = name.startswith("attnx")
        if is_attnx and args.peers_only:
            continue
        reason = cases.skip_reason(case, name, args.quick)
        if is_attnx and reason is None and not cases.attnx_supports(case, attnx, name):
            reason = "attnx.%s is missing" % cases.attnx_requirement(case, name)
        if reason:
            skipped[name] = reason
        else:
            names.append(name)
    return skipped, names


def as_array(result):
    return result.numpy() if hasattr(result, "numpy") else np.asarray(result)


def disagreements(first_results, dtype):
    """{name: relative max difference} of the answers that disagree with the
    reference (attnx's, or the first competitor's)."""
    answers = {name: as_array(r) for name, r in first_results.items() if r is not None}
    if len(answers) < 2 or not np.issubdtype(next(iter(answers.values())).dtype, np.floating):
        return {}
    reference = answers.pop("attnx", None)
    if reference is None:
        reference = answers.pop(next(iter(answers)))
    scale = max(float(np.max(np.abs(reference))), np.finfo(reference.dtype).tiny)
    errors = {name: float(np.max(np.abs(answer - reference))) / scale for name, answer in answers.items()}
    return {name: error for name, error in errors.items()
            if not error <= TOLERANCE.get(dtype, TOLERANCE["float32"])}


@functools.lru_cache(maxsize=None)
def gemm_reference(dtype):
    """The gemm timed in the rounds of every case with counted FLOPs, so that
    its rate and the case's are taken under the same machine load."""
    case = cases.gemm_case(dtype)
    return cases.build_call(case, cases.make_inputs(case), "numpy-openblas", None)


def result_record(case, stats, skipped, wrong):
    flops = cases.case_flops(case)
    competitors = {}
    for name, s in stats.items():
        name_flops = cases.case_flops(cases.gemm_case(case.dtype)) if name == "gemm" else flops
        competitors[name] = s.as_dict()
        competitors[name]["gflops"] = name_flops / s.median / 1e9 if name_flops else None
        # the fastest call against the machine's multiply-add peak (main measures it)
        competitors[name]["peak_fraction"] = (PEAK.flops_fraction(name_flops / s.min, case.dtype)
                                              if name_flops and PEAK else None)
    return {"label": case.label, "key": case.key, "kind": case.kind, "series": case.series,
            "n": case.n, "dtype": case.dtype, "case": dataclasses.asdict(case) | {"window": case.window},
            "flops": flops, "competitors": competitors, "skipped": skipped, "disagreements": wrong}


def run_case(case, attnx, settings, args):
    skipped, names = competitor_plan(case, attnx, args)
    inputs = cases.make_inputs(case)
    calls = {name: cases.build_call(case, inputs, name, attnx) for name in names}
    if calls and case.kind in cases.FLOP_KINDS:
        calls["gemm"] = gemm_reference(case.dtype)
    stats, first_results, failures = harness.measure(calls, settings)
    skipped.update({name: "raised " + message for name, message in failures.items()})
    first_results.pop("gemm", None)
    wrong = disagreements(first_results, case.dtype)
    return result_record(case, stats, skipped, wrong)


def progress_line(result, seconds):
    unit, scale = report.TIME_UNIT.get(result["kind"], ("ms", 1e3))
    times = ", ".join("%s %s" % (name, report.format_value(s["median_s"] * scale))
                      for name, s in result["competitors"].items())
    rounds = len(next(iter(result["competitors"].values()))["samples_s"]) if result["competitors"] else 0
    line = "  %-40s %s %s  [%d rounds, %.0f s]" % (result["label"], times, unit, rounds, seconds)
    for name, error in result["disagreements"].items():
        line += "\n  WARNING: %s disagrees with the reference answer (relative error %.2g)" % (name, error)
    return line


# ------------------------------------------------------------ the suite

def progress(items, description):
    """items under a tqdm progress bar on stderr, when tqdm is installed and
    stderr is a terminal (logs and pipes get the result lines alone)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=description, leave=False, disable=not sys.stderr.isatty())


def say(line):
    """Print a result line above the progress bar (when there is one)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(line, flush=True)
        return
    tqdm.write(line)
    sys.stdout.flush()


def merge_gemm(start, end):
    """One gemm record from the measurements at the start and end of the run."""
    merged = dict(start)
    stats = harness.Stats(start["competitors"]["numpy-openblas"]["samples_s"] +
                          end["competitors"]["numpy-openblas"]["samples_s"],
                          start["competitors"]["numpy-openblas"]["number"])
    merged["competitors"] = {"numpy-openblas": stats.as_dict() | {"gflops": start["flops"] / stats.median / 1e9}}
    merged["gflops_start_end"] = [r["competitors"]["numpy-openblas"]["gflops"] for r in (start, end)]
    return merged


def run_timed(args, attnx, settings):
    selected = [c for c in cases.timed_cases(args.quick) if args.only in c.label]
    gemm_start = [run_case(c, attnx, settings, args) for c in cases.gemm_cases()]
    for record in gemm_start:
        print("  gemm %s 2048^3: %.1f GFLOP/s" % (record["dtype"], record["competitors"]["numpy-openblas"]["gflops"]),
              flush=True)
    results = []
    for index, case in enumerate(progress(selected, "timing"), 1):
        started = time.perf_counter()
        results.append(run_case(case, attnx, settings, args))
        say("[%d/%d]" % (index, len(selected)) + progress_line(results[-1], time.perf_counter() - started))
    gemm_end = [run_case(c, attnx, settings, args) for c in cases.gemm_cases()]
    return [merge_gemm(s, e) for s, e in zip(gemm_start, gemm_end)] + results


def run_memory(args, attnx):
    if args.no_memory:
        return []
    selected = [(case, impl) for case, impl in memory.probes(args.quick) if args.only in case.label
                and (cases.attnx_supports(case, attnx, impl) or not impl.startswith("attnx"))]
    probes = []
    for case, impl in progress(selected, "memory"):
        probes.append(memory.run_probe(case, impl, args.threads))
        outcome = probes[-1].get("extra_bytes")
        shown = "%.1f MiB" % (outcome / report.MIB) if outcome is not None else (
            probes[-1].get("skipped") or probes[-1].get("error"))
        say("  memory %-36s %-18s %s" % (case.label, impl, shown))
    return probes


def load_warning(info):
    busy = info["busy_cores_at_start"]
    if busy is None or busy <= BUSY_CORES:
        return []
    return ["warning: other processes keep %.2f cores busy: times are inflated and "
            "multi-threaded calls stall at their barriers; compare ratios, rerun when the "
            "machine is idle" % busy]


def missing_notes(attnx):
    if attnx is None:
        return []
    needed = {cases.attnx_requirement(case, name): (case, name) for case in cases.timed_cases(False)
              for name in cases.COMPETITORS[case.kind] if name.startswith("attnx")}
    return ["note: attnx.%s is missing; what calls it is skipped" % path
            for path, (case, name) in sorted(needed.items())
            if not cases.attnx_supports(case, attnx, name)]


def report_body(results, probes, seconds):
    return "\n".join([report.tables(results), report.memory_table(probes), "",
                      report.legend(report.gemm_gflops(results)), "",
                      "design targets (docs/performance.md):"] +
                     report.targets(results, probes) + ["", "total time %.0f s" % seconds])


def write_outputs(base, header, body, info, results, probes):
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with open(base + ".txt", "w") as f:
        f.write("\n".join(header + [body]) + "\n")
    report.write_json(base + ".json", info, results, probes, report.targets(results, probes))
    written = [base + ".json", base + ".txt"]
    if report.plot(base + ".png", results, header[0]):
        written.append(base + ".png")
    print("wrote " + ", ".join(written))


def main():
    args = parse_args()
    attnx = import_attnx(args.peers_only)
    set_threads(args.threads, attnx)
    info = machine_info(attnx)
    global PEAK
    PEAK = harness.machine_peak(args.threads)
    info["machine_peak"] = PEAK.__dict__ if PEAK else None
    header = ([machine_line(info)] + ([PEAK.describe()] if PEAK else []) + load_warning(info) +
              missing_notes(attnx))
    print("\n".join(header), flush=True)
    started = time.perf_counter()
    results = run_timed(args, attnx, SETTINGS["quick" if args.quick else "full"])
    probes = run_memory(args, attnx)
    info["busy_cores_at_end"] = busy_cores()
    body = report_body(results, probes, time.perf_counter() - started)
    print(body)
    mode = ("quick" if args.quick else "full") + ("-peers-only" if args.peers_only else "")
    write_outputs(os.path.join(os.path.abspath(args.out), "bench-" + mode), header, body, info,
                  results, probes)
    return 1 if any(r["disagreements"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
