"""Which modules may import what (imports parsed with `ast`, so nothing here runs): the layers
below the trainer do not reach up into it, vLLM stays behind engines/vllm/ and Ray behind
distributed/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specrl"
MODULES = sorted(PACKAGE.rglob("*.py"))


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in a file, at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def where(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_the_scan_sees_the_package():
    assert len(MODULES) > 60 and any(where(p) == "speculative/stage.py" for p in MODULES)


@pytest.mark.parametrize("layer", ["engines", "speculative", "algorithms"])
def test_lower_layers_import_neither_the_trainer_nor_distributed_and_only_config_schemas(layer):
    for path in (PACKAGE / layer).rglob("*.py"):
        for module, names in imports(path):
            assert not module.startswith(("specrl.trainer", "specrl.distributed")), where(path)
            if module == "specrl.config":
                assert all(name.endswith("Config") for name in names), (where(path), names)


@pytest.mark.parametrize(("library", "home"), [("vllm", "engines/vllm/"), ("ray", "distributed/")])
def test_only_its_home_imports_a_heavy_library(library, home):
    outside = [
        where(path)
        for path in MODULES
        for module, _ in imports(path)
        if module.split(".")[0] == library and not where(path).startswith(home)
    ]
    assert outside == []


def test_no_module_is_over_400_lines_and_the_loop_fits_in_250():
    lines = {where(p): len(p.read_text().splitlines()) for p in MODULES}
    assert {m: n for m, n in lines.items() if n > 400} == {}
    assert lines["trainer.py"] <= 250


def test_the_design_doc_module_map_names_every_module():
    """docs/design.md's module map names every module: by its path, or its file name on its
    package's line."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    module_map = design.split("## Module map", 1)[1].split("```")[1]
    words = set(module_map.replace(",", " ").replace("(", " ").replace(")", " ").split())
    missing = [
        where(p)
        for p in MODULES
        if p.name != "__init__.py"
        and where(p) not in words
        and not (p.name in words and f"{p.parent.relative_to(PACKAGE).as_posix()}/" in words)
    ]
    assert missing == []


def test_engines_are_known_by_name_only_in_config_and_engines():
    """Outside specrl/config (where the user's string is read) and specrl/engines (the registry
    that builds one and says what each is: `EngineKind`), code asks what an engine can do, never
    which one it is."""
    import re

    by_name = re.compile(r"""rollout\.name\s*[!=]=|[!=]=\s*["'](hf|vllm)["']""")
    outside = [
        f"{where(path)}:{number}"
        for path in MODULES
        if not where(path).startswith(("config/", "engines/"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if by_name.search(line)
    ]
    assert outside == []
