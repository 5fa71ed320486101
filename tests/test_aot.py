"""Ahead-of-time compilation of the kernels, for every architecture they can run on.

No GPU is needed: ``tileiras`` (``pip install tilemm[tileiras]``) compiles for sm_90 / sm_100 / sm_120
on a CPU-only machine, so a kernel that stops compiling (a cuTile API change, a shape or dtype the
compiler rejects, a tile that no longer fits) fails CI. Each test compiles one ``AotVariant`` of one
module for one target and checks that a cubin (an ELF image) comes back.

What the default run compiles: for each kernel function and target, the first variant its module
lists (about 50 cubins), and each kernel function once more with no alignment facts; so a kernel that
stops compiling anywhere fails the default run within a few minutes on 2 cores.

The full sweep (``pytest -m aot --aot-all``, or ``-m aot_full``; CI runs it after the default run)
compiles every code path on every target, and every tuning setting of every kernel function on every
target. A variant's code path is its kernel function and, parameter by parameter,

* for an array: its rank, and its dtype unless that is a 16/32-bit float (an input or output
  precision: fp32 / bf16 / fp16 take the same path), so that FP8 data, packed e2m1 bytes, e8m0 / e4m3
  scale bytes and int32 amax words keep their paths apart;
* for a constant: its value (format, element code, scale block, swizzled or not, transposed or not,
  TMA store or not, ...), except the tuning constants in ``TUNING`` (tile shapes, pipeline latencies,
  group sizes, chunk sizes), and ``SPLIT_K``, which counts only as split or not.

Its tuning settings are those constants, its compiler hints (occupancy, CTAs per cluster) and the
dtype of each array. The modules list the cross product of all of these that their launchers can
pick (about 2,900 cases); the sweep takes, after the default selection,
the listed variant that covers the most not yet covered (in the modules' order) until nothing is left
uncovered: about a quarter of them. ``test_full_sweep_compiles_every_path_and_every_setting`` checks
that cover; ``--aot-every`` compiles the whole cross product (``-m aot_every``: only the cases beyond
the sweep).

Each kernel is also compiled with no alignment facts (``test_unaligned_variant_compiles``), the
specialisation the JIT builds for odd strides: by default once per kernel function, with
``--aot-all`` once per distinct hinted kernel and target.

Cost: about 5 s of compiler time per cubin on one core (the sweep: 38 minutes on 2 cores from an empty
cache; the whole cross product about 3.5 times that). cuTile keeps compiled cubins in
~/.cache/cutile-python (``CUDA_TILE_CACHE_DIR`` moves it; ``off`` disables it), so a second run only
compiles what changed. cuTile reads a kernel's source file when it compiles, so editing kernel sources
while this runs gives spurious failures.
"""

from __future__ import annotations

import dataclasses
import heapq
import importlib
import inspect
import pkgutil

import pytest

pytestmark = pytest.mark.aot

# Every module of tilemm.kernels that offers aot_variants() is compiled, each variant for the targets
# its launcher can pick it on (Hopper kernels sm_90; Blackwell kernels sm_100 / sm_120; portable
# kernels, such as the quantizers, all three).
FAMILY_TARGETS = {"hopper": ("sm_90",), "blackwell": ("sm_100", "sm_120")}

# Kernel constants that choose how fast a kernel runs, not what it computes or which code it runs.
TUNING = {"TILE_R", "TILE_K", "TM", "TN", "TK", "TR", "LATENCY", "LATENCY_A", "LATENCY_B", "LATENCY_W",
          "LATENCY_X", "GROUP_SIZE_M", "CHUNK", "WHOLE_R", "WHOLE_K"}
PRECISION_DTYPES = {"float32", "float16", "bfloat16"}


def _compiler_missing() -> str | None:
    """Why tileiras cannot be found, or None. (cuTile looks it up the same way when it compiles.)"""
    try:
        from cuda.tile._compile import _find_compiler_bin

        _find_compiler_bin()
    except FileNotFoundError as err:
        return f"needs the cuTile compiler tileiras (pip install tilemm[tileiras]): {err}"
    return None


COMPILER_MISSING = _compiler_missing()
needs_compiler = pytest.mark.skipif(COMPILER_MISSING is not None, reason=COMPILER_MISSING or "")


def _kernel_modules():
    import tilemm.kernels

    names = sorted(m.name for m in pkgutil.iter_modules(tilemm.kernels.__path__) if not m.name.startswith("_"))
    modules = {name: importlib.import_module(f"tilemm.kernels.{name}") for name in names}
    return {name: mod for name, mod in modules.items() if hasattr(mod, "aot_variants")}


MODULES = _kernel_modules()


def _allowed_targets(name: str):
    family = name.split("_", 1)[0]
    return FAMILY_TARGETS.get(family, ("sm_90", "sm_100", "sm_120"))


def _kernel_function(variant):
    """The Python function under a (possibly hinted) cuTile kernel."""
    return getattr(variant.kernel, "_pyfunc", variant.kernel)


def _path_and_settings(variant):
    """(code path, tuning settings) of a variant, as the module docstring defines them."""
    from cuda.tile import compilation as cc

    fn = _kernel_function(variant)
    names = list(inspect.signature(fn).parameters)
    path, settings = [f"{fn.__module__}.{fn.__qualname__}"], {("hints", repr(getattr(variant.kernel, "_compiler_options", None)))}
    for name, param in zip(names, variant.params):
        if isinstance(param, cc.ArrayConstraint):
            dtype = str(param.dtype)
            path.append((name, "float" if dtype in PRECISION_DTYPES else dtype, param.ndim))
            settings.add((name, dtype))
        elif name == "SPLIT_K":
            path.append((name, param > 1))
            settings.add((name, param))
        elif name in TUNING:
            settings.add((name, param))
        else:
            path.append((name, repr(param)))
    return tuple(path), settings


def _all_cases():
    """Every (module, variant, target), in the modules' order."""
    for name, module in MODULES.items():
        for variant in module.aot_variants():
            for target in variant.targets:
                yield name, variant, target


def _default_selection(cases):
    """The indices of ``cases`` that the default run compiles: the first variant of every kernel function
    and target."""
    chosen, seen = [], set()
    for i, (_, variant, target) in enumerate(cases):
        key = (_kernel_function(variant), target)
        if key not in seen:
            seen.add(key)
            chosen.append(i)
    return chosen


def _covered(case):
    """What compiling one case shows: its code path on its target, and each of its tuning settings for
    its kernel function on its target."""
    _, variant, target = case
    path, settings = _path_and_settings(variant)
    fn = _kernel_function(variant)
    fn = f"{fn.__module__}.{fn.__qualname__}"  # two modules may name a kernel alike
    return {("path", path, target)} | {("setting", fn, target, s) for s in settings}


def _sweep_selection(cases, default):
    """The indices of ``cases`` that the full sweep compiles: the default selection, then, greedily in the
    modules' order, the case that adds the most not yet covered, until every code path on every target and
    every tuning setting of every kernel function on every target is covered."""
    covers = [_covered(case) for case in cases]
    chosen = set(default)
    done = set().union(*(covers[i] for i in chosen))
    # Lazy greedy: a case's gain only shrinks as more is covered, so a stale gain is an upper bound and
    # a case whose fresh gain still heads the heap is the greedy choice (ties go to the first listed).
    heap = [(-len(c - done), i) for i, c in enumerate(covers) if c - done]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        gain = len(covers[i] - done)
        if gain and heap and (-gain, i) > heap[0]:
            heapq.heappush(heap, (-gain, i))
        elif gain:
            chosen.add(i)
            done |= covers[i]
    return chosen


ALL_CASES = list(_all_cases())
DEFAULT = set(_default_selection(ALL_CASES))
SWEEP = _sweep_selection(ALL_CASES, DEFAULT)


def _param(name, variant, target, *, default: bool, sweep: bool = True, suffix=""):
    """A test case: one outside the default selection carries the ``aot_full`` marker, one outside the
    full sweep as well the ``aot_every`` marker."""
    short = variant.name.removeprefix(f"{name}_")
    marks = [] if default else [pytest.mark.aot_full] if sweep else [pytest.mark.aot_full, pytest.mark.aot_every]
    return pytest.param(name, variant, target, id=f"{name}-{short}{suffix}-{target}", marks=marks)


@needs_compiler
@pytest.mark.parametrize("module_name,variant,target",
                         [_param(*case, default=i in DEFAULT, sweep=i in SWEEP) for i, case in enumerate(ALL_CASES)])
def test_variant_compiles(module_name, variant, target):
    from tilemm.kernels._aot import compile_variant

    assert target in _allowed_targets(module_name), (
        f"{variant.name} lists target {target}, which {module_name}'s family does not run on")
    cubin = compile_variant(variant, target)
    assert len(cubin) > 0
    assert cubin[:4] == b"\x7fELF", f"{variant.name} for {target}: not a cubin"


@pytest.mark.parametrize("module_name", list(MODULES))
def test_module_lists_variants_with_unique_names(module_name):
    """Every module offers at least one specialisation per family target, under unique names (the
    names become the cubins' kernel symbols)."""
    module = MODULES[module_name]
    variants = module.aot_variants()
    names = [v.name for v in variants]
    assert len(names) == len(set(names)), "duplicate variant names"
    covered = {t for v in variants for t in v.targets}
    assert covered == set(_allowed_targets(module_name)), f"targets covered: {sorted(covered)}"


def test_default_run_compiles_every_kernel_on_every_target():
    """The default selection compiles every kernel function on every target it runs on, and is small
    (the README's test command has a time budget); the rest carries the aot_full marker."""
    default = [ALL_CASES[i] for i in sorted(DEFAULT)]
    every = {(_kernel_function(v), t) for _, v, t in ALL_CASES}
    assert {(_kernel_function(v), t) for _, v, t in default} == every
    assert len(default) == len(every) < 60
    unaligned = list(_unaligned_cases())
    assert sum(1 for p in unaligned if not p.marks) == len({_kernel_function(v) for _, v, _ in ALL_CASES})


def test_full_sweep_compiles_every_path_and_every_setting():
    """The full sweep (``--aot-all``: the cases without the aot_every marker) holds every code path on
    every target, and every tuning value, hint set and array dtype of every kernel function on every
    target; ``--aot-every`` adds the rest of the listed combinations."""
    (parametrize,) = [m for m in test_variant_compiles.pytestmark if m.name == "parametrize"]
    marked = [{m.name for m in p.marks} for p in parametrize.args[1]]  # the marks the tests carry
    assert len(marked) == len(ALL_CASES)
    assert all("aot_full" in names for names in marked if "aot_every" in names)  # the default run drops both
    swept = [case for case, names in zip(ALL_CASES, marked) if "aot_every" not in names]
    assert set().union(*map(_covered, swept)) == set().union(*map(_covered, ALL_CASES))
    paths = {(_path_and_settings(v)[0], t) for _, v, t in ALL_CASES}
    assert len(DEFAULT) < len(paths) <= len(swept) < len(ALL_CASES)  # both selections are real reductions
    assert sum(1 for names in marked if names) == len(ALL_CASES) - len(DEFAULT)


def test_split_and_precision_are_paths_but_tile_shapes_are_not():
    """The path key on real variants: mxfp8's stream kernel with and without split-K differ in path,
    fp32 and bf16 outputs (or two tile shapes) of one kernel do not."""
    variants = {v.name: v for v in MODULES["hopper_block_scaled"].aot_variants()}
    path = {name: _path_and_settings(v)[0] for name, v in variants.items()}
    base = "hopper_mxfp8_e4m3_swz_{}_stream_{}"
    assert path[base.format("bf16", "128x128x128_s1_x16")] == path[base.format("fp32", "128x128x128_s1_x16")]
    assert path[base.format("bf16", "128x128x128_s1_x16")] == path[base.format("bf16", "64x128x128_s1_occ2_x16")]
    assert path[base.format("bf16", "128x128x128_s2")] == path[base.format("bf16", "128x128x128_s8")]
    assert path[base.format("bf16", "128x128x128_s1_x16")] != path[base.format("bf16", "128x128x128_s2")]
    # e4m3 and e5m2 data, and swizzled and logical scales, are separate paths.
    assert path[base.format("bf16", "128x128x128_s1_x16")] != path[
        "hopper_mxfp8_e5m2_swz_bf16_stream_128x128x128_s1_x16"]
    assert path[base.format("bf16", "128x128x128_s1_x16")] != path[
        "hopper_mxfp8_e4m3_log_bf16_stream_128x128x128_s1_x16"]


def _unaligned(param):
    """An array parameter with no alignment facts: what the JIT specialises on for a tensor whose base
    address or strides are not multiples of 16 bytes (an odd row length, a sliced view)."""
    from cuda.tile import compilation as cc

    if isinstance(param, cc.ArrayConstraint):
        return dataclasses.replace(param, stride_divisible_by=1, base_addr_divisible_by=1)
    return param


def _unaligned_cases():
    """One variant per hinted kernel and target (the first that a module lists for it), with every array
    unaligned; those beyond the first per kernel function run only in the full sweep."""
    seen, seen_function = set(), set()
    for name, variant, target in ALL_CASES:
        kernel = repr(variant.kernel)
        if (kernel, target) in seen:
            continue
        seen.add((kernel, target))
        key = _kernel_function(variant)
        yield _param(name, variant, target, default=key not in seen_function, suffix="-unaligned")
        seen_function.add(key)


@needs_compiler
@pytest.mark.parametrize("module_name,variant,target", list(_unaligned_cases()))
def test_unaligned_variant_compiles(module_name, variant, target):
    """The byte-aligned specialisation of each kernel compiles too (it is the one that runs for odd
    strides, and it takes other code paths: no TMA)."""
    from tilemm.kernels._aot import AotVariant, compile_variant

    loose = AotVariant(variant.name + "_unaligned", variant.kernel, [_unaligned(p) for p in variant.params],
                       variant.targets)
    cubin = compile_variant(loose, target)
    assert cubin[:4] == b"\x7fELF", f"{loose.name} for {target}: not a cubin"
