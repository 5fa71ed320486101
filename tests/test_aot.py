"""Ahead-of-time compilation of every kernel specialisation, for every architecture it can run on.

No GPU is needed: ``tileiras`` compiles for sm_90 / sm_100 / sm_120 on a CPU-only machine, so a kernel
that stops compiling (a cuTile API change, a shape or dtype the compiler rejects, a tile that no
longer fits) fails CI. Each test compiles one ``AotVariant`` of one module for one target and checks
that a cubin (an ELF image) comes back.

Cost: about 1-2 s per cubin with a cold cuTile cache (cuTile caches cubins in ~/.cache/cutile-python;
set CUDA_TILE_CACHE_DIR=off to measure the cold cost). The Blackwell modules give 96 cubins: about
80 s of compiler time on a quiet 2-core machine, 3.3 minutes when it is busy. cuTile reads a kernel's
source file when it compiles, so editing kernel sources while this runs gives spurious failures.
"""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.aot

# module -> the targets its family runs on (tilemm.kernels: Hopper sm_90, Blackwell sm_100 / sm_120).
MODULES = {
    "hopper_block_scaled": ("sm_90",),
    "hopper_fp8": ("sm_90",),
    "blackwell_block_scaled": ("sm_100", "sm_120"),
    "blackwell_fp8": ("sm_100", "sm_120"),
}

# The Hopper modules are written alongside; until they land, a missing module is skipped (as with
# pytest.importorskip) rather than failing collection. Set True once all four exist.
REQUIRE_ALL_MODULES = False


def _load(name: str):
    """The kernel module, or None if it does not exist yet (and REQUIRE_ALL_MODULES is off)."""
    path = f"tilemm.kernels.{name}"
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if REQUIRE_ALL_MODULES or e.name != path:
            raise
        return None


def _cases():
    for name, family_targets in MODULES.items():
        module = _load(name)
        if module is None:
            yield pytest.param(name, None, None, id=f"{name}-missing",
                               marks=pytest.mark.skip(reason=f"tilemm.kernels.{name} does not exist yet"))
            continue
        for variant in module.aot_variants():
            short = variant.name.removeprefix(f"{name}_")
            for target in variant.targets:
                yield pytest.param(name, variant, target, id=f"{name}-{short}-{target}")


CASES = list(_cases())


@pytest.mark.parametrize("module_name,variant,target", CASES)
def test_variant_compiles(module_name, variant, target):
    from tilemm.kernels._aot import compile_variant

    assert target in MODULES[module_name], (
        f"{variant.name} lists target {target}, which {module_name}'s family does not run on")
    cubin = compile_variant(variant, target)
    assert len(cubin) > 0
    assert cubin[:4] == b"\x7fELF", f"{variant.name} for {target}: not a cubin"


@pytest.mark.parametrize("module_name", list(MODULES))
def test_module_lists_variants_with_unique_names(module_name):
    """Every module offers at least one specialisation per family target, under unique names (the
    names become the cubins' kernel symbols)."""
    module = _load(module_name)
    if module is None:
        pytest.skip(f"tilemm.kernels.{module_name} does not exist yet")
    variants = module.aot_variants()
    names = [v.name for v in variants]
    assert len(names) == len(set(names)), "duplicate variant names"
    covered = {t for v in variants for t in v.targets}
    assert covered == set(MODULES[module_name]), f"targets covered: {sorted(covered)}"
