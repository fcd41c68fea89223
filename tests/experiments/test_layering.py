"""experiments/ is layered by pipeline stage: an import never points from a stage to a later one."""

import ast
from pathlib import Path

import pytest

import affdiv.experiments

ROOT = Path(affdiv.experiments.__file__).parent
# The stages in pipeline order; a module may import its own stage and earlier ones only.
STAGES = ["data", "records", "runs", "analysis", "report", "probe", "plan", "pipeline", "cli"]


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["affdiv", "experiments"] or len(parts) < 3:
        return None
    return parts[2]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_points_to_a_later_stage(path):
    own = path.relative_to(ROOT).parts[0].removesuffix(".py")
    assert own in STAGES, f"{path}: not in a known stage {STAGES}"
    later = [name for name in _imports(path)
             if (stage := _stage(name)) in STAGES and STAGES.index(stage) > STAGES.index(own)]
    assert not later, f"{path.relative_to(ROOT)} ({own}) imports a later stage: {later}"


def test_the_test_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from affdiv.experiments.report.writer import write_report\n")
    assert [n for n in _imports(bad) if _stage(n) == "report"]


# The packages in dependency order: a package may import its own and earlier ones only (the root
# modules — atomic, provenance, reporting, _extras, cli — are shared by all; cli loads every
# package's command module by name, not by import).
PACKAGES = ["layers", "theory", "verify", "meter", "experiments"]
PACKAGE_ROOT = ROOT.parent


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "affdiv" and len(parts) > 1 and parts[1] in PACKAGES else None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_a_later_one(package):
    later = {f"{path.relative_to(PACKAGE_ROOT)}: {name}"
             for path in (PACKAGE_ROOT / package).rglob("*.py") for name in _imports(path)
             if (other := _package(name)) and PACKAGES.index(other) > PACKAGES.index(package)}
    assert not later, f"{package} imports a later package: {sorted(later)}"


def test_every_package_is_in_the_order():
    packages = {p.parent.name for p in PACKAGE_ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "build"}
    assert packages == set(PACKAGES)


def test_the_stage_table_names_every_module():
    """DEVELOPERS.md's stage table lists every module of experiments/ in the row of its stage."""
    guide = (Path(__file__).resolve().parents[2] / "DEVELOPERS.md").read_text()  # the checkout, not the install
    rows = {}
    for line in guide.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`experiments/"):
            rows[cells[0].strip("`").removeprefix("experiments/").rstrip("/").removesuffix(".py")] = cells[1]
    missing = []
    for path in MODULES:
        parts = path.relative_to(ROOT).parts
        if path.name == "__init__.py":
            continue
        if len(parts) == 1:
            if path.stem not in rows:
                missing.append(str(path.relative_to(ROOT)))
        elif f"`{path.stem}`" not in rows.get(parts[0], ""):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"DEVELOPERS.md's stage table does not list: {missing}"
