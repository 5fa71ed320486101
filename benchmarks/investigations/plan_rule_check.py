"""What the large-M plan's rules (``hopper_weight_only_large.RULES``) would reach on a measured sweep,
offline (no GPU): for every (format, N x K, M) of a ``tune_weight_only_large.py`` run (its ``--json``
file, or the text it printed: ratios rounded to 0.01), the candidate the rules pick, and per weight
family and M the geomean speed-up over cuBLAS bf16 of

* ``rule``: the rules' pick on each shape (as measured in the sweep);
* ``best``: the fastest measured candidate on each shape (the ceiling of any plan over these
  candidates; ``old2pass`` is no option);
* ``family``: one candidate per (family, M), the one with the best geomean over the shapes (what a
  table with a row per M and no shape quantities reaches);
* ``wired``: the ``plan`` column, where the sweep timed the layer as the committed plan dispatched it.

    python benchmarks/investigations/plan_rule_check.py benchmarks/results/tune-weight-only-large-nvidia-h100-80gb-hbm3.txt

A problem whose pick the sweep did not time (a candidate left out) is named in the listing and left
out of the ``rule`` geomean of its (family, M), which is then marked ``*``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import sys
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's tilemm
from tilemm.kernels import weight_only_kernels as wo  # noqa: E402
from tilemm.kernels import hopper_weight_only_large as wl  # noqa: E402


#: Measured columns that are no option of the plan: the plan itself, the old two-pass reference.
NOT_OPTIONS = {"plan", "old2pass"}


def layout_of_format(fmt: str):
    return wo.LAYOUTS.get(fmt) or wo.LAYOUTS[f"{fmt}_e4m3"]


def candidate_name(cfg, measured=()) -> str:
    """The sweep's name for a plan entry (None: the small-M plan). A fused config with a K split is
    the sweep's ``<config>_sauto`` column (``with_split``'s split), as is an unsplit fused config that
    the sweep timed only there (``with_split`` gave it no split on that shape)."""
    if cfg is None:
        return "small"
    if cfg.kind == "fused":
        sauto = dataclasses.replace(cfg, split_k=1).name + "_sauto"
        if cfg.split_k > 1 or (cfg.name not in measured and sauto in measured):
            return sauto
    return cfg.name


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def check(rows: list, sms: int, rules: dict | None = None, out=print) -> dict:
    """Prints the per-problem picks and the per-(family, M) geomeans; returns
    {(family, m): {"rule": g, "best": g, "family": g, "wired": g}}."""
    per = defaultdict(dict)  # (fmt, family, n, k, m) -> {candidate: ratio}
    for r in rows:
        per[(r["fmt"], r["family"], r["n"], r["k"], r["m"])][r["cand"]] = r["vs_bf16"]
    groups = defaultdict(list)
    for key in per:
        groups[(key[1], key[4])].append(key)
    result = {}
    out("# per problem: the rules' pick (its ratio) | the measured best (its ratio)")
    for (fam, m), keys in sorted(groups.items()):
        names = set.intersection(*(set(per[key]) - NOT_OPTIONS for key in keys))
        fam_best = max(names, key=lambda c: geomean(per[key][c] for key in keys)) if names else None
        rule_vals, best_vals, fam_vals, wired_vals, missing = [], [], [], [], False
        for key in sorted(keys):
            fmt, _, n, k, _ = key
            cands = {c: v for c, v in per[key].items() if c not in NOT_OPTIONS}
            cfg = wl.plan(m, n, k, layout_of_format(fmt), rules, sms)
            if cfg is None and wo.short_k_stacked(m, n, k, layout_of_format(fmt), sms):
                # The small-M plan's stacked blocks without a K split, which these sweeps did not time
                # (benchmarks/results/gemv-few-rows-*): left out of every geomean.
                out(f"{fmt} {n}x{k} M={m}: the small-M plan's unsplit stacked blocks (not in this sweep)")
                continue
            pick = candidate_name(cfg, cands)
            best = max(cands, key=cands.get)
            best_vals.append(cands[best])
            if fam_best is not None:
                fam_vals.append(cands[fam_best])
            if "plan" in per[key]:
                wired_vals.append(per[key]["plan"])
            if pick in cands:
                rule_vals.append(cands[pick])
                got = f"{pick} {cands[pick]:.2f}"
            else:
                missing = True
                got = f"{pick} (not timed)"
            out(f"{fmt} {n}x{k} M={m}: {got} | {best} {cands[best]:.2f}")
        result[(fam, m)] = {"rule": geomean(rule_vals), "best": geomean(best_vals),
                            "family": geomean(fam_vals), "wired": geomean(wired_vals), "missing": missing}
    out("\n# geomean over shapes: rules | per-shape best | one candidate per (family, M) | wired plan")
    for (fam, m), g in sorted(result.items()):
        out(f"{fam} M={m}: rule {g['rule']:.2f}{'*' if g['missing'] else ''} | best {g['best']:.2f} | "
            f"family {g['family']:.2f} | wired {g['wired']:.2f}")
    return result


_LINE = re.compile(r"^(\w+) (\d+)x(\d+) M=(\d+) bf16 [\d.]+us \| (.*)$")


def read_rows(path: str) -> tuple[list, int]:
    """(rows, SMs) of a sweep: its JSON, or the text it printed (one line per problem, ``name ratio``
    cells; the SMs from its ``# <GPU>, <n> SMs`` line)."""
    text = pathlib.Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
        return data["rows"], data.get("sms", 132)
    rows, sms = [], 132
    for line in text.splitlines():
        found = re.search(r", (\d+) SMs,", line) if line.startswith("#") else None
        if found:
            sms = int(found.group(1))
        match = _LINE.match(line)
        if not match:
            continue
        fmt, n, k, m, cells = match.groups()
        fam = wl.family(layout_of_format(fmt))
        for cell in cells.split(" | "):
            name, _, value = cell.rpartition(" ")
            if name and not value.startswith("("):  # "name: FAILED (...)" cells are no measurement
                rows.append({"fmt": fmt, "family": fam, "n": int(n), "k": int(k), "m": int(m), "cand": name,
                             "vs_bf16": float(value)})
    return rows, sms


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    rows, sms = read_rows(argv[0])
    check(rows, sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
