"""``python -m tilemm`` / ``python -m tilemm.demo``: the command line a new user runs first."""

import pathlib
import subprocess
import sys

import pytest

from tilemm import demo

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_python_dash_m_tilemm_runs_the_demo_help():
    # Run from the repository root so that this checkout's tilemm is the one imported.
    done = subprocess.run([sys.executable, "-m", "tilemm", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m tilemm [-h] [--m M] [--n N] [--k K]")
    assert "``" not in done.stdout  # no reStructuredText markup in a terminal
    text = " ".join(done.stdout.split())  # argparse wraps to the terminal width
    for words in ("--m M rows of x", "--n N rows of w", "--k K the shared dimension", "a multiple of 32"):
        assert words in text, done.stdout


@pytest.mark.parametrize("argv,message", [
    (["--k", "100"], "argument --k: must be a multiple of 32, got 100"),
    (["--m", "0"], "argument --m: must be a positive integer, got 0"),
    (["--n", "-3"], "argument --n: must be a positive integer, got -3"),
    (["--k", "1e3"], "argument --k: must be a positive integer, got '1e3'"),
])
def test_bad_sizes_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2  # argparse's usage error, not a traceback
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m tilemm.demo") and message in err


def test_demo_checks_every_format_against_the_reference(capsys):
    assert demo.main(["--m", "3", "--n", "20", "--k", "64"]) == 0
    out = capsys.readouterr().out
    for name in demo.FORMATS:
        row = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert row.endswith(" ok"), row
    assert "all formats agree with the reference" in out
