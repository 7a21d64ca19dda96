"""The CPU dispatch (csrc/cpu_features.c, csrc/dispatch.c): the tables filled
at import from the CPU's features less ATTNX_DISABLE_CPU_FEATURES, the test
hook that fills them again through the same code, the levels tests/levels.py
runs the subset under, and what show_config and cpu_dispatch report."""

import os
import platform
import re
import subprocess
import sys

import pytest

import attnx
from helpers import cpuinfo_field, dispatched, kernels_here

HERE = os.path.dirname(os.path.abspath(__file__))
import conftest  # noqa: E402
import levels  # noqa: E402


def test_dispatch_setting_names():
    """The test hook refuses unknown features, families and kernel sets, and
    sets a family's table does not hold, leaving every choice as it was."""
    before = attnx.cpu_dispatch()
    for args, message in [(("AVX1024",), "unknown CPU features: AVX1024"),
                          (("", {"softmax": "plain"}), "unknown family 'softmax'"),
                          (("", {"decode": "mk"}), "unknown kernel set 'mk' for decode"),
                          (("", {"softmax_backward": "avx512_group"}),
                           "softmax_backward has no kernel set avx512_group here"),
                          (("", {"decode": 1}), "unknown kernel set 1 for decode")]:
        with pytest.raises(ValueError, match=message):
            attnx._C._set_dispatch(*args)
        assert attnx.cpu_dispatch() == before
    with pytest.raises(TypeError, match="limits must be a dict"):
        attnx._C._set_dispatch("", ["plain"])
    # every set but plain needs features this CPU has
    here = kernels_here("softmax_forward")
    assert here[-1] == "plain"
    cpu = set(attnx._C.build_info()["cpu_features"])
    needs = {"avx2": {"AVX2", "FMA3", "F16C"}, "avx512": {"AVX512F", "AVX512DQ"},
             "avx512_bf16": {"AVX512F", "AVX512_BF16"}, "amx": {"AMX_TILE", "AMX_BF16"},
             "neon": {"ASIMD"}}
    for name in here[:-1]:
        assert needs[name] <= cpu, (name, cpu)
    if "avx512" in here:       # a build with AVX-512 kernels has the AVX2 ones
        assert "avx2" in here


def _import_in_child(env_changes, code):
    env = {key: val for key, val in os.environ.items()
           if key not in ("ATTNX_DISABLE_CPU_FEATURES", "ATTNX_AMX", "ATTNX_SOFTMAX_BACKEND")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-W", "default", "-c", code], env=env,
                          capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__))))


@pytest.mark.parametrize("disabled", ["AMX", "AVX512F", "AVX512F,AVX2", "AVX512_BF16 AMX", ""])
def test_disabled_cpu_features_from_the_environment(disabled):
    """ATTNX_DISABLE_CPU_FEATURES (numpy's names, separated by commas or
    spaces) fills the tables at import as the test hook does here."""
    run = _import_in_child({"ATTNX_DISABLE_CPU_FEATURES": disabled},
                           "import attnx; print(sorted(attnx.cpu_dispatch().items()))")
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr, run.stderr
    with dispatched(disabled) as chosen:
        assert run.stdout.strip() == str(sorted(chosen.items()))


def test_unknown_and_retired_settings_warn():
    """As numpy does for NPY_DISABLE_CPU_FEATURES, a name it does not know
    gives an ImportWarning and leaves nothing out; ATTNX_SOFTMAX_BACKEND and
    ATTNX_AMX, which only the softmax forward read, are no longer read, and
    a warning names what replaced them."""
    code = "import attnx; print(sorted(attnx.cpu_dispatch().items()))"
    run = _import_in_child({"ATTNX_DISABLE_CPU_FEATURES": "AVX1024,avx512f"}, code)
    assert run.returncode == 0, run.stderr
    assert "ImportWarning" in run.stderr and "AVX1024 avx512f" in run.stderr, run.stderr
    # nothing left out, whatever this process's own environment leaves out
    with dispatched("") as chosen:
        assert run.stdout.strip() == str(sorted(chosen.items()))
    for retired in ("ATTNX_SOFTMAX_BACKEND=plain", "ATTNX_AMX=0"):
        name, value = retired.split("=")
        run = _import_in_child({name: value}, code)
        assert run.returncode == 0, run.stderr
        assert f"UserWarning: {name} is no longer read" in run.stderr, run.stderr
        assert "ATTNX_DISABLE_CPU_FEATURES" in run.stderr


def test_every_family_has_plain_kernels_and_a_fixture():
    """Each family's table ends with the plain C code, and tests/conftest.py
    has a fixture that runs a test on each of its sets."""
    for family in attnx.cpu_dispatch():
        assert kernels_here(family)[-1] == "plain"
        assert hasattr(conftest, f"{family}_kernels")


def test_levels_this_machine_can_force():
    """tests/levels.py finds the plain level everywhere, every level it runs
    changes what some family runs, and the levels' choices are what the
    hook gives for the same features."""
    found = levels.levels_here()
    assert found[-1][0] == "plain"
    assert set(found[-1][2].values()) == {"plain"}
    for (_, _, upper), (_, _, lower) in zip(found, found[1:]):
        assert upper != lower
    for _, disabled, chosen in found:
        with dispatched(disabled) as here:
            assert here == chosen


# the families with AVX2+FMA and NEON kernels of their own (csrc/dispatch.c)
VECTOR_FAMILIES = ["softmax_forward", "softmax_backward", "linear_forward", "linear_backward",
                   "decode", "lsh", "convert", "delta_rule"]


def test_avx2_level_runs_the_avx2_kernels():
    """With AVX-512 left out, as ATTNX_DISABLE_CPU_FEATURES=AVX512F leaves it
    on an AVX2-only machine, every family that has AVX2 kernels chooses them
    where the build and the CPU have them (the softmax forward's AVX2 set
    says so), and none chooses an AVX-512 set."""
    with dispatched("AVX512F") as chosen:
        avx2_here = "avx2" in kernels_here("softmax_forward")
        for family in VECTOR_FAMILIES:
            if avx2_here:
                assert chosen[family] == "avx2", (family, chosen)
            else:
                assert "avx2" not in kernels_here(family), family
        assert not any(kernels.startswith(("avx512", "amx")) for kernels in chosen.values())


def test_every_x86_set_needs_f16c():
    """The AVX2 and AVX-512 sets read float16 keys and values and convert
    float16 with F16C's instructions, so a CPU without it (as
    ATTNX_DISABLE_CPU_FEATURES=F16C says) runs none of them"""
    with dispatched("F16C") as chosen:
        assert set(chosen.values()) <= {"neon", "plain"}, chosen


# ------------------------------------------------- names grep can find

CSRC = os.path.join(os.path.dirname(HERE), "csrc")
TYPED_SUFFIX = r"_(?:f32|f64|w16|w8|d8|d4|n4|nd2)"
# SFX(name) defines name_f32 and name_f64 (csrc/real.h), MK_NAME(name) one
# kernel per instruction set (csrc/microkernel.h)
MACRO_SUFFIXES = {"SFX": ("_f32", "_f64"), "MK_NAME": ("_w16", "_d8", "_w8", "_d4", "_n4", "_nd2")}


def _defined_at(text, start):
    """Whether the name ending at `start` begins a definition: more names of
    the same macro (TYPED(a_f32, a_f64)), then the parameters, then a body."""
    match = re.compile(r"[\w\s,]*\)?\s*\(").match(text, start)
    if not match:
        return False
    depth, i = 1, match.end()
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[i:].lstrip().startswith("{")


def test_grep_finds_every_typed_kernel_by_the_name_it_is_called_by():
    """Every C function that some file calls (or puts in a table) by its
    typed name, attnx_linear_fwd_f32 or mk_scores_w16, has that name
    spelled in its definition (TYPED, MK_TYPED or the literal name), so
    that `grep -n attnx_linear_fwd_f32 csrc/*` finds its body, not only
    its declaration and its callers."""
    attributes = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")
    sources = {}
    for name in sorted(os.listdir(CSRC)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(CSRC, name)) as f:
                sources[name] = attributes.sub("", f.read())
    functions = set()
    for text in sources.values():
        for match in re.finditer(r"\b(SFX|MK_NAME)\((\w+)\)\(", text):
            if _defined_at(text, match.end() - 1):
                functions.update(match.group(2) + s for s in MACRO_SUFFIXES[match.group(1)])
        for match in re.finditer(r"\b(\w+" + TYPED_SUFFIX + r")\b", text):
            if _defined_at(text, match.end()):
                functions.add(match.group(1))
    used = set()
    for text in sources.values():
        used.update(re.findall(r"\b\w+" + TYPED_SUFFIX + r"\b", text))
    called = used & functions
    assert len(called) > 50    # attnx_*_f32/_f64, the micro-kernels
    unfound = sorted(name for name in called
                     if not any(_defined_at(text, m.end()) for text in sources.values()
                                for m in re.finditer(r"\b" + name + r"\b", text)))
    assert not unfound, f"defined only through SFX() or MK_NAME(): {unfound}"


def _sysfs_l2_bytes():
    """The first core's level-2 cache as Linux describes it, or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    if not os.path.isdir(base):
        return None
    for index in sorted(os.listdir(base)):
        try:
            with open(os.path.join(base, index, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(base, index, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        if level == "2" and size.endswith("K"):
            return int(size[:-1]) * 1024
    return None


def test_cpu_vendor_and_the_sets_slower_on_its_cores():
    """build_info's cpu_vendor is the maker Linux names too; the bfloat16
    dot products' set (avx512_bf16) is passed over on Intel's cores, whose
    VDPBF16PS does half the flops of their FMAs (csrc/dispatch.c's
    slower_on), and chosen elsewhere; held to it, a family runs it on any
    maker's CPU, so the tests still run it there."""
    vendor = attnx._C.build_info()["cpu_vendor"]
    assert vendor in ("intel", "amd", "other")
    named = cpuinfo_field("vendor_id")
    if named is not None and re.match(r"x86_64|AMD64", platform.machine()):
        assert vendor == {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(named, "other")
    elif not re.match(r"x86_64|AMD64", platform.machine()):
        assert vendor == "other"
    for family in ("softmax_forward", "softmax_backward"):
        if "avx512_bf16" not in kernels_here(family):
            continue
        with dispatched(**{family: "avx512_bf16"}) as chosen:
            assert chosen[family] == "avx512_bf16"
        with dispatched() as chosen:
            if vendor == "intel":
                assert chosen[family] in ("amx", "avx512")
            else:
                assert chosen[family] == "avx512_bf16"


def test_softmax_backward_blocks_follow_the_l2():
    info = attnx._C.build_info()
    l2 = info["l2_cache_bytes"]
    assert l2 >= 0
    if l2:
        assert l2 % 1024 == 0
        sysfs = _sysfs_l2_bytes()
        if sysfs is not None:
            assert l2 == sysfs
    else:
        # x86-64 always answers (CPUID leaf 0x80000006); elsewhere nothing is asked
        assert not re.match(r"x86_64|AMD64", platform.machine())
    assert info["softmax_backward_block"] == (64 if 0 < l2 < 2**20 else 128)
    for side in (64, 128):
        before = attnx._C._softmax_backward_block(side)
        try:
            assert before == 0
            assert attnx._C.build_info()["softmax_backward_block"] == side
        finally:
            assert attnx._C._softmax_backward_block(0) == side
    assert attnx._C.build_info()["softmax_backward_block"] == info["softmax_backward_block"]
    for wrong in (-1, 32, 96, 256):
        with pytest.raises(ValueError, match="0, 64 or 128"):
            attnx._C._softmax_backward_block(wrong)
    assert attnx._C.build_info()["softmax_backward_block"] == info["softmax_backward_block"]
