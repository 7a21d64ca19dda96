"""Build the attnx extension.

BLAS choice (environment variable ATTNX_BLAS):
  unset / "scipy-openblas"  OpenBLAS from the scipy-openblas32 wheel (a build
                            requirement); its shared library and licence are
                            copied into the package and found through an
                            $ORIGIN rpath, as a wheel repair tool would do.
  "system"                  a system OpenBLAS found by pkg-config (Debian:
                            apt-get install libopenblas-dev pkg-config).
ATTNX_DEBUG=1 builds -O0 -g with AddressSanitizer and UBSan (see
tests/run_sanitizers.sh).

Compilers: gcc or clang (CC=clang) on Linux, x86-64 and aarch64 (OpenMP
from libgomp, or LLVM's libomp with clang: Debian's libomp-dev); Apple
clang on macOS with LLVM's libomp (Homebrew's, or the prefix in
OpenMP_ROOT). Windows: not yet (the kernels' GNU C vector extensions, which
MSVC lacks; .ci/windows builds and tests the kernels with mingw-w64 under
wine): a build stops with a message saying so.

The only run path written into the module is the package's own folder
($ORIGIN / @loader_path): the build machine's library paths that Python's
own link command carries (LDSHARED's -Wl,-rpath,...) are removed, so a
built module never looks for libraries where it was built.
"""
import glob
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = sorted(glob.glob("csrc/*.c"))


def fail(message):
    sys.exit("attnx build error: " + message)


def scipy_openblas():
    # read from its files, not imported: its import loads the library, which
    # fails when the build is for another machine (a cross-compile)
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None:
        fail("no BLAS found. Install one of:\n"
             "  pip install scipy-openblas32        (the default; pip does this\n"
             "                                       itself for `pip install .`)\n"
             "  apt-get install libopenblas-dev pkg-config, then build with\n"
             "  ATTNX_BLAS=system")
    package_dir = list(spec.submodule_search_locations)[0]
    lib_dir = os.path.join(package_dir, "lib")
    shared = (".so", ".dylib", ".lib")
    lib_names = sorted(f for f in os.listdir(lib_dir)
                       if f.startswith("libscipy_openblas") and f.endswith(shared))
    if not lib_names:
        fail("the scipy-openblas32 package in %s holds no library" % package_dir)
    lib_file = os.path.join(lib_dir, lib_names[0])
    # the link name: without "lib" for -l, whole for MSVC's libscipy_openblas.lib
    link_name = os.path.splitext(lib_names[0])[0]
    if sys.platform != "win32":
        link_name = link_name[len("lib"):]
    version = importlib.metadata.version("scipy-openblas32")
    info = {
        "include_dirs": [os.path.join(package_dir, "include")],
        "library_dirs": [lib_dir],
        "libraries": [link_name],
        "define_macros": [("ATTNX_BLAS_SCIPY_PREFIX", "1"),
                          ("ATTNX_BLAS_NAME", '"scipy-openblas32 %s"' % version)],
        "bundle": [lib_file],
        "licenses": [],
    }
    dist = os.path.dirname(package_dir)
    for entry in os.listdir(dist):
        if entry.startswith("scipy_openblas32") and entry.endswith(".dist-info"):
            lic_dir = os.path.join(dist, entry, "licenses")
            if os.path.isdir(lic_dir):
                info["licenses"] += [os.path.join(lic_dir, f) for f in os.listdir(lic_dir)]
    if not info["licenses"]:
        fail("the scipy-openblas32 wheel has no licence text to ship with its library")
    return info


def system_openblas():
    try:
        cflags = subprocess.check_output(["pkg-config", "--cflags", "openblas"], text=True).split()
        libs = subprocess.check_output(["pkg-config", "--libs", "openblas"], text=True).split()
        version = subprocess.check_output(["pkg-config", "--modversion", "openblas"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        fail("ATTNX_BLAS=system but pkg-config finds no 'openblas'. Install it\n"
             "  (Debian: apt-get install libopenblas-dev pkg-config) or unset ATTNX_BLAS\n"
             "  to use the scipy-openblas32 wheel.")
    return {
        "include_dirs": [f[2:] for f in cflags if f.startswith("-I")],
        "library_dirs": [f[2:] for f in libs if f.startswith("-L")],
        "libraries": [f[2:] for f in libs if f.startswith("-l")],
        "define_macros": [("ATTNX_BLAS_NAME", '"system openblas %s"' % version)],
        "bundle": [],
        "licenses": [],
    }


choice = os.environ.get("ATTNX_BLAS", "scipy-openblas")
if choice == "system":
    blas = system_openblas()
elif choice in ("", "scipy-openblas", "scipy-openblas32"):
    blas = scipy_openblas()
else:
    fail("unknown ATTNX_BLAS=%r (use 'system' or leave it unset)" % choice)

def openmp_flags():
    """(compile, link, include_dirs, library_dirs) for OpenMP on this platform."""
    if sys.platform == "darwin":
        # Apple clang has no -fopenmp driver flag: the preprocessor takes it,
        # and LLVM's libomp (brew install libomp) supplies omp.h and the runtime
        root = os.environ.get("OpenMP_ROOT")
        if not root:
            try:
                root = subprocess.check_output(["brew", "--prefix", "libomp"], text=True).strip()
            except (OSError, subprocess.CalledProcessError):
                fail("OpenMP on macOS needs LLVM's libomp: brew install libomp\n"
                     "  (or set OpenMP_ROOT to a prefix holding include/omp.h and lib/libomp.dylib)")
        return (["-Xpreprocessor", "-fopenmp"], ["-lomp"],
                [os.path.join(root, "include")], [os.path.join(root, "lib")])
    return ["-fopenmp"], ["-fopenmp"], [], []


if sys.platform == "win32":
    fail("Windows is not supported yet: the kernels use GNU C vector extensions,\n"
         "  which MSVC (the compiler setuptools uses on Windows) lacks. They build\n"
         "  with mingw-w64's gcc and clang and pass their C tests under wine\n"
         "  (.ci/windows), but this module has not been built or tested on Windows.\n"
         "  Use WSL or Linux.")

debug = os.environ.get("ATTNX_DEBUG", "") not in ("", "0")
if debug:
    opt = ["-O0", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
           "-fno-sanitize-recover=undefined"]
    link_opt = ["-fsanitize=address,undefined"]
else:
    # No -ffast-math: inf and NaN must keep their IEEE meaning (masked rows,
    # propagation of NaN inputs). Hot loops are vectorised by target_clones.
    opt = ["-O3", "-fno-math-errno", "-fno-trapping-math"]
    link_opt = []

omp_compile, omp_link, omp_include, omp_lib = openmp_flags()
# the bundled libraries sit beside the module
own_folder = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"

ext = Extension(
    "attnx._C",
    sources=SOURCES,
    depends=[os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".h")],
    include_dirs=[numpy.get_include(), "csrc"] + blas["include_dirs"] + omp_include,
    library_dirs=blas["library_dirs"] + omp_lib,
    libraries=blas["libraries"] + ["m"],
    define_macros=blas["define_macros"] + [
        ("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION"),
        ("NPY_TARGET_VERSION", "NPY_1_22_API_VERSION"),
    ],
    extra_compile_args=["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
    + omp_compile + opt,
    extra_link_args=omp_link + ["-Wl,-rpath," + own_folder] + link_opt,
)


def without_run_paths(args):
    """args without the linker options that write a run path: -Wl,-rpath,DIR,
    -Wl,-rpath=DIR, -Wl,-R,DIR, -Wl,-RDIR, and -Wl,-rpath -Wl,DIR in two."""
    kept, skip_next = [], False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg in ("-Wl,-rpath", "-Wl,--rpath", "-Wl,-R"):
            skip_next = True
        elif not arg.startswith(("-Wl,-rpath", "-Wl,--rpath", "-Wl,-R")):
            kept.append(arg)
    return kept


def replace_file(src, dst):
    """Copy under a new name, then rename: a process that has the old file
    mapped keeps its copy instead of crashing on the rewritten pages."""
    shutil.copy2(src, dst + ".tmp")
    os.replace(dst + ".tmp", dst)


def is_clang(command):
    """True when the compiler command (a list, as setuptools holds it) is clang."""
    try:
        version = subprocess.run(command[:1] + ["--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "clang" in version


# clang cannot vectorise a max reduction under IEEE rules (a NaN is kept
# apart, lsh.c's row max), and says so for every `omp simd reduction(max)`;
# that loop runs one number at a time there
CLANG_ARGS = ["-Wno-pass-failed"]


class BuildExtBundlingBlas(build_ext):
    """Copy the bundled BLAS library and its licences next to the module."""

    def build_extensions(self):
        if is_clang(self.compiler.compiler_so):
            for extension in self.extensions:
                extension.extra_compile_args = extension.extra_compile_args + CLANG_ARGS
        # Python's link command (sysconfig LDSHARED) may carry the run path
        # of the interpreter's own lib folder (pyenv, conda): not ours to ship
        linker = getattr(self.compiler, "linker_so", None)
        if linker:
            self.compiler.linker_so = without_run_paths(linker)
        super().build_extensions()

    def run(self):
        module_path = self.get_ext_fullpath("attnx._C")
        if self.inplace and os.path.exists(module_path):
            os.unlink(module_path)  # as replace_file: running processes keep theirs
        super().run()
        package_dir = os.path.dirname(module_path)
        for lib in blas["bundle"]:
            replace_file(lib, os.path.join(package_dir, os.path.basename(lib)))
        if blas["licenses"]:
            lic_dir = os.path.join(package_dir, "licenses")
            os.makedirs(lic_dir, exist_ok=True)
            for lic in blas["licenses"]:
                replace_file(lic, os.path.join(lic_dir, "OpenBLAS-" + os.path.basename(lic)))


setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtBundlingBlas})
