"""attnx: exact, fast attention on the CPU over numpy arrays.

Softmax (scaled dot product) attention computed FlashAttention-style, and the
kernelised "linear" family, in C with OpenBLAS. Every function takes
q (..., n, d), k (..., m, d), v (..., m, e) and returns (..., n, e); the
leading axes broadcast like a gufunc. See README.md for the conventions.
"""
import os as _os

import numpy as _numpy  # noqa: F401  (numpy's own BLAS loads under the user's settings)


def _explain_unbuilt(error):
    """Python's own message when this folder holds no built extension
    ("cannot import name '_C' from partially initialized module 'attnx'
    (most likely due to a circular import)") points at the wrong cause. The
    usual one: a source checkout's unbuilt attnx/ folder imported from the
    current directory, ahead of the copy `pip install .` built elsewhere.
    Raise an ImportError saying so; return when an extension file is here
    (it failed for another reason, which the caller re-raises)."""
    import importlib.machinery
    import sys

    here = _os.path.dirname(_os.path.abspath(__file__))
    if any(_os.path.exists(_os.path.join(here, "_C" + suffix))
           for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return
    checkout = _os.path.dirname(here)
    on_path = [_os.path.abspath(entry or _os.curdir) for entry in sys.path]
    message = f"attnx's C extension is not built in {here}"
    installed = None
    if checkout in on_path:
        message += (f": this is the unbuilt attnx/ folder of a source checkout, imported "
                    f"because {checkout} is on sys.path (the current directory or the "
                    f"script's folder)")
        others = [entry for entry, where in zip(sys.path, on_path) if where != checkout]
        installed = importlib.machinery.PathFinder.find_spec("attnx", others)
    if installed is not None and installed.origin:
        message += (f". It hides the installed attnx at "
                    f"{_os.path.dirname(installed.origin)}: run Python from outside the "
                    f"checkout, or install the checkout in place with `pip install -e .`.")
    else:
        message += f". Build it in place: `pip install -e .` in {checkout}."
    raise ImportError(message) from error


def _hwcap2():
    """AT_HWCAP2 of this process (Linux: the CPU features the kernel, or an
    emulator, advertises), 0 where it cannot be read."""
    import struct

    try:
        with open("/proc/self/auxv", "rb") as f:
            auxv = f.read()
    except OSError:
        return 0
    for key, value in struct.iter_unpack("QQ", auxv[:len(auxv) // 16 * 16]):
        if key == 26:  # AT_HWCAP2
            return value
    return 0


def _openblas_core():
    """The OPENBLAS_CORETYPE the extension's OpenBLAS must load with where the
    kernels it would choose for this CPU are known to fail, else None (the
    user's own OPENBLAS_CORETYPE always wins):
    - x86-64 without SSSE3: OpenBLAS 0.3.34 chooses its Nehalem kernels,
      which use SSSE3 (SIGILL); Prescott's need SSE3 only;
    - aarch64 Linux advertising SME (HWCAP2_SME): it chooses its SME core,
      whose products came out wrong on such a CPU (an emulated one); the
      Armv8 SVE core, or plain Armv8, computes them."""
    import platform

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        try:
            from numpy._core._multiarray_umath import __cpu_features__ as features
        except ImportError:  # numpy 1.x
            from numpy.core._multiarray_umath import __cpu_features__ as features
        if features.get("SSSE3") is False:
            return "Prescott"
    elif machine == "aarch64" and _hwcap2() & (1 << 23):  # HWCAP2_SME
        try:
            from numpy._core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        return "ARMV8SVE" if features.get("SVE") else "ARMV8"
    return None


def _load_extension():
    """Import the extension with its OpenBLAS told to start no threads
    (attnx runs BLAS single-threaded inside its own OpenMP pool, and an idle
    BLAS thread pool would spin on the cores that pool needs), and on a core
    that works here (_openblas_core). OpenBLAS reads both when it loads,
    with the extension; the variables are put back after."""
    settings = {"OPENBLAS_NUM_THREADS": "1"}
    core = _openblas_core()
    if core and not _os.environ.get("OPENBLAS_CORETYPE"):
        settings["OPENBLAS_CORETYPE"] = core
    saved = {name: _os.environ.get(name) for name in settings}
    _os.environ.update(settings)
    try:
        from . import _C
    except ImportError as error:
        _explain_unbuilt(error)
        raise
    finally:
        for name, value in saved.items():
            if value is None:
                del _os.environ[name]
            else:
                _os.environ[name] = value
    return _C


_C = _load_extension()
from ._C import (gaussian_attention, get_num_threads, set_num_threads, set_output_cache,
                 softmax_attention)
from ._grad import Gradients, vjp
from ._softmax import gaussian_attention_backward, softmax_attention_backward
from ._inspect import attention_weights, similarity
from . import layouts
from ._systems import (
    block_sparse_attention,
    block_sparse_attention_backward,
    linformer_attention,
    linformer_attention_backward,
    pooled_attention,
    pooled_attention_backward,
)
from ._lsh import lsh_attention, lsh_attention_backward, lsh_buckets, lsh_rotations
from ._delta import (DeltaRuleGradients, DeltaRuleState, delta_rule_attention,
                     delta_rule_attention_backward)
from ._multihead import MultiHeadGradients, multi_head_attention, multi_head_attention_backward
from ._positions import rotary, rotary_backward, sinusoidal_positions
from ._linear import (
    LinearAttentionState,
    cosformer_attention,
    efficient_attention,
    focused_linear_attention,
    linear_attention,
    performer_attention,
    random_features,
    taylor_attention,
)
from ._linear_grad import (
    cosformer_attention_backward,
    efficient_attention_backward,
    focused_linear_attention_backward,
    linear_attention_backward,
    performer_attention_backward,
    taylor_attention_backward,
)

__version__ = "0.1.0"

__all__ = [
    "softmax_attention",
    "gaussian_attention",
    "softmax_attention_backward",
    "gaussian_attention_backward",
    "linear_attention",
    "cosformer_attention",
    "focused_linear_attention",
    "taylor_attention",
    "performer_attention",
    "efficient_attention",
    "linear_attention_backward",
    "cosformer_attention_backward",
    "focused_linear_attention_backward",
    "taylor_attention_backward",
    "performer_attention_backward",
    "efficient_attention_backward",
    "random_features",
    "LinearAttentionState",
    "attention_weights",
    "similarity",
    "multi_head_attention",
    "multi_head_attention_backward",
    "MultiHeadGradients",
    "sinusoidal_positions",
    "rotary",
    "rotary_backward",
    "block_sparse_attention",
    "block_sparse_attention_backward",
    "pooled_attention",
    "pooled_attention_backward",
    "linformer_attention",
    "linformer_attention_backward",
    "lsh_attention",
    "lsh_attention_backward",
    "lsh_buckets",
    "lsh_rotations",
    "delta_rule_attention",
    "delta_rule_attention_backward",
    "DeltaRuleState",
    "DeltaRuleGradients",
    "layouts",
    "Gradients",
    "vjp",
    "get_num_threads",
    "set_num_threads",
    "set_output_cache",
    "show_config",
    "cpu_dispatch",
]


def cpu_dispatch():
    """The kernel set each family of calls runs on this CPU.

    Returns
    -------
    dict
        ``{family: kernel set}``: "plain" (C + BLAS), "avx2", "avx512",
        "avx512_bf16" (with bfloat16 dot products), "avx512_group" (decoding
        four heads at once), "amx", "neon" (aarch64's Advanced SIMD).

    Raises
    ------
    None
        This function does not raise.

    See Also
    --------
    show_config : Prints the same beside the BLAS and threads.

    Notes
    -----
    Chosen once at import from the CPU's features, less those the
    environment variable ``ATTNX_DISABLE_CPU_FEATURES`` leaves out
    (comma-separated, numpy's spelling: ``AVX512F``, ``AMX``, ``AVX2``,
    ``FMA3``, ...). A call whose shape a set's kernels do not take runs the
    plain code. Tests ask this table what ran instead of assuming the CPU.

    Examples
    --------
    >>> import attnx
    >>> choice = attnx.cpu_dispatch()
    >>> "softmax_forward" in choice and all(isinstance(v, str) for v in choice.values())
    True
    """
    return dict(_C.build_info()["dispatch"])


def show_config():
    """Print the BLAS, SIMD level, kernels per family, threads and numpy in use.

    Returns
    -------
    None
        The configuration is printed to standard output.

    Raises
    ------
    None
        This function does not raise.

    See Also
    --------
    get_num_threads : The thread count alone.
    set_output_cache : The result-reuse limit printed.

    Notes
    -----
    The lines name the BLAS attnx was built with (single-threaded inside
    attnx's OpenMP pool), the SIMD level of the kernels, each family's
    kernel set (`cpu_dispatch`), the CPU features
    ``ATTNX_DISABLE_CPU_FEATURES`` left out, whether AMX and the bfloat16
    dot product are in use, the softmax backward's block side (smaller
    where a core's L2 is under 1 MiB), the threads, the output cache's
    limit, numpy's version and the compiler. Include them in a bug report.

    Examples
    --------
    >>> import attnx
    >>> attnx.show_config()  # doctest: +ELLIPSIS
    attnx 0.1.0
      BLAS: ...
      threads: ...
    """
    import numpy

    info = _C.build_info()
    print(f"attnx {__version__}")
    print(f"  BLAS:     {info['blas']}, {info['blas_core']} kernels "
          f"(single-threaded inside attnx's OpenMP pool)")
    print(f"  SIMD:     {info['simd']}")
    features = ", ".join(info["cpu_features"]) or "no features attnx dispatches on"
    print(f"  CPU:      {features} ({info['cpu_vendor']})")
    disabled = ", ".join(info["disabled_cpu_features"]) or "none"
    print(f"  disabled: {disabled} (ATTNX_DISABLE_CPU_FEATURES)")
    print("  kernels:  " + ", ".join(f"{family} {kernels}"
                                     for family, kernels in info["dispatch"].items()))
    l2 = info["l2_cache_bytes"]
    l2_text = f"L2 {l2 // 1024} KiB a core" if l2 else "L2 not asked on this CPU"
    print(f"  blocks:   softmax backward {info['softmax_backward_block']} x "
          f"{info['softmax_backward_block']} ({l2_text})")
    print(f"  threads:  {get_num_threads()} (OMP_NUM_THREADS or attnx.set_num_threads)")
    limit = set_output_cache(0)
    set_output_cache(limit)
    print(f"  results:  freed ones of 1 MiB or more reused, up to {limit / 2**20:g} MiB "
          f"(attnx.set_output_cache)")
    print(f"  numpy:    {numpy.__version__}")
    print(f"  compiler: {info['compiler']}")
