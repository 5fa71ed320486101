"""The documentation the repository ships: every file it cites exists, and README code runs."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for pattern in ("tilemm/**/*.py", "swizzle/**/*.py", "tests/*.py", "benchmarks/**/*.py",
                             "benchmarks/*.md", "benchmarks/*.sh",
                             "notebooks/*.ipynb", "*.md", "docs/*.md")
           for p in sorted(ROOT.glob(pattern))]


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert {"quantize.py", "README.md", "numerics.md", "01_formats.ipynb"} <= names


def _source_param(path):
    return pytest.param(path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("path", [_source_param(p) for p in SOURCES])
def test_cited_documents_exist(path):
    text = path.read_text(encoding="utf-8")
    # Documents that live outside the repository cannot be cited.
    assert not re.search(r"\b(NUMERICS|STYLE)\.md\b", text), f"{path.name} cites a file the repository lacks"
    for cited in set(re.findall(r"\bdocs/[\w./-]+\.md\b", text)):
        assert (ROOT / cited).is_file(), f"{path.name} cites {cited}, which does not exist"
    # A benchmark script or results file named by its path (patterns such as ``<gpu>`` or ``*`` aside).
    for cited in sorted(set(re.findall(r"\bbenchmarks/[\w./-]+\.(?:py|sh|md|json|txt|png|log)\b", text))):
        assert (ROOT / cited).is_file(), f"{path.name} cites {cited}, which does not exist"


def _readme_python_blocks():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_python_examples():
    assert len(_readme_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_readme_python_blocks())))
def test_readme_python_block_runs_as_written(index):
    # Each block runs on its own, on whatever machine runs the tests (a CPU one in CI).
    code = _readme_python_blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def test_install_commands_name_real_extras_and_the_cpu_install_needs_no_compiler():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # The base install runs the CPU path: cuda-tile without its 540 MB compiler extra.
    assert any(d.startswith("cuda-tile") for d in project["dependencies"])
    assert not any("tileiras" in d for d in project["dependencies"])
    assert "cuda-tile[tileiras]>=1.7" in extras["tileiras"]
    # Every extra the README or CI installs exists, and CI installs the compiler for the aot tests.
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    named = {e.strip() for text in (readme, ci) for group in re.findall(r'-e "\.\[([\w,]+)\]"', text)
             for e in group.split(",")}
    assert named >= {"dev", "tileiras", "cute"} and named <= set(extras)
    assert re.search(r'-e "\.\[[\w,]*tileiras[\w,]*\]"', ci)
    assert "--aot-all" in ci


def test_readme_opens_with_a_two_command_quick_start():
    # The first section: one command installs and runs the demo, one installs the development extras
    # (with what notebooks/04_checkpoints.ipynb needs) and runs the tests, on a CPU-only machine.
    import tomllib

    text = (ROOT / "README.md").read_text()
    first = re.search(r"^## (.+)$", text, flags=re.M)
    assert first.group(1) == "Quick start"
    section = text[first.end():text.index("\n## ", first.end())]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
                for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    demo, tests = commands
    cpu_torch = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert demo.startswith(cpu_torch) and demo.endswith("python -m tilemm")
    assert tests.startswith(cpu_torch) and tests.endswith("python -m pytest -q")
    extras = set(re.search(r'-e "\.\[([\w,]+)\]"', tests).group(1).split(","))
    assert {"dev", "tileiras", "test"} <= extras
    # The dev extra brings a Jupyter front end, and the README says how to open the tutorials.
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("notebook") for d in dev) and any(d.startswith("nbconvert") for d in dev)
    assert "jupyter notebook notebooks/" in text
