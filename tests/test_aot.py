"""Ahead-of-time compilation of every kernel specialisation, for every architecture it can run on.

No GPU is needed: ``tileiras`` compiles for sm_90 / sm_100 / sm_120 on a CPU-only machine, so a kernel
that stops compiling (a cuTile API change, a shape or dtype the compiler rejects, a tile that no
longer fits) fails CI. Each test compiles one ``AotVariant`` of one module for one target and checks
that a cubin (an ELF image) comes back.

Cost: about 1-2 s per cubin with a cold cuTile cache (cuTile caches cubins in ~/.cache/cutile-python;
set CUDA_TILE_CACHE_DIR=off to measure the cold cost). The Blackwell modules give 96 cubins: about
80 s of compiler time on a quiet 2-core machine, 3.3 minutes when it is busy. cuTile reads a kernel's
source file when it compiles, so editing kernel sources while this runs gives spurious failures.
Each kernel is also compiled once with no alignment facts (``test_unaligned_variant_compiles``: 34
cubins, about 50 s), the specialisation the JIT builds for odd strides.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

pytestmark = pytest.mark.aot

# Every module of tilemm.kernels that offers aot_variants() is compiled, each variant for the targets
# its launcher can pick it on (Hopper kernels sm_90; Blackwell kernels sm_100 / sm_120; portable
# kernels, such as the quantizers, all three).
FAMILY_TARGETS = {"hopper": ("sm_90",), "blackwell": ("sm_100", "sm_120")}


def _kernel_modules():
    import pkgutil

    import tilemm.kernels

    names = sorted(m.name for m in pkgutil.iter_modules(tilemm.kernels.__path__) if not m.name.startswith("_"))
    modules = {name: importlib.import_module(f"tilemm.kernels.{name}") for name in names}
    return {name: mod for name, mod in modules.items() if hasattr(mod, "aot_variants")}


MODULES = _kernel_modules()


def _allowed_targets(name: str):
    family = name.split("_", 1)[0]
    return FAMILY_TARGETS.get(family, ("sm_90", "sm_100", "sm_120"))


def _cases():
    for name, module in MODULES.items():
        for variant in module.aot_variants():
            short = variant.name.removeprefix(f"{name}_")
            for target in variant.targets:
                yield pytest.param(name, variant, target, id=f"{name}-{short}-{target}")


CASES = list(_cases())


@pytest.mark.parametrize("module_name,variant,target", CASES)
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


def _unaligned(param):
    """An array parameter with no alignment facts: what the JIT specialises on for a tensor whose base
    address or strides are not multiples of 16 bytes (an odd row length, a sliced view)."""
    from cuda.tile import compilation as cc

    if isinstance(param, cc.ArrayConstraint):
        return dataclasses.replace(param, stride_divisible_by=1, base_addr_divisible_by=1)
    return param


def _unaligned_cases():
    """One variant per kernel and target (the first that a module lists for it), with every array
    unaligned."""
    for name, module in MODULES.items():
        seen = set()
        for variant in module.aot_variants():
            kernel = getattr(variant.kernel, "__name__", None) or repr(variant.kernel)
            short = variant.name.removeprefix(f"{name}_")
            for target in variant.targets:
                if (kernel, target) not in seen:
                    seen.add((kernel, target))
                    yield pytest.param(name, variant, target, id=f"{name}-{short}-unaligned-{target}")


@pytest.mark.parametrize("module_name,variant,target", list(_unaligned_cases()))
def test_unaligned_variant_compiles(module_name, variant, target):
    """The byte-aligned specialisation of each kernel compiles too (it is the one that runs for odd
    strides, and it takes other code paths: no TMA)."""
    from tilemm.kernels._aot import AotVariant, compile_variant

    loose = AotVariant(variant.name + "_unaligned", variant.kernel, [_unaligned(p) for p in variant.params],
                       variant.targets)
    cubin = compile_variant(loose, target)
    assert cubin[:4] == b"\x7fELF", f"{loose.name} for {target}: not a cubin"
