"""What a wheel carries: every package and every file the package reads at run time.

The end-to-end check (build the wheel, install it non-editable in a fresh venv, train from another
directory) is in .ci/run; these tests catch the usual way it breaks, a new subpackage or data folder that
pyproject.toml does not name, in a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine import resources

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib") if sys.version_info < (3, 11) else __import__("tomllib")


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_engine_package_is_shipped():
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "engine").rglob("__init__.py")}
    listed = set(setuptools_table()["packages"])
    mapped = set(setuptools_table()["package-dir"]) - {""}
    assert packages <= listed, f"add {sorted(packages - listed)} to [tool.setuptools] packages"
    assert listed - packages <= mapped | {"engine.optim.csrc"}, "a listed package has no folder"


@pytest.mark.parametrize("folder,name", [("schemas", "engine.schema.json"), ("configs", "default.json")])
def test_run_time_files_are_package_data(folder, name):
    table = setuptools_table()
    package = f"engine.{folder}"
    assert table["package-dir"][package] == folder  # the top-level folder stays the source
    assert any(Path(name).match(pattern) for pattern in table["package-data"][package])
    assert resources.data_path(folder, name) == ROOT / folder / name  # a checkout reads the source


def test_c_source_is_package_data():
    from engine.optim import fused_kernel

    patterns = setuptools_table()["package-data"]["engine.optim.csrc"]
    assert fused_kernel._SRC.is_file() and any(fused_kernel._SRC.match(p) for p in patterns)


def test_installed_copy_wins_over_a_folder_beside_the_package(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    for root in (site / "engine" / "schemas", site / "schemas"):
        root.mkdir(parents=True)
        (root / "engine.schema.json").write_text("{}")
    monkeypatch.setattr(resources, "PACKAGE", site / "engine")
    assert resources.data_path("schemas", "engine.schema.json") == site / "engine" / "schemas" / "engine.schema.json"
    (site / "engine" / "schemas" / "engine.schema.json").unlink()
    (site / "schemas" / "engine.schema.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"schemas/engine.schema.json is missing .*pip install \."):
        resources.data_path("schemas", "engine.schema.json")


def test_a_shipped_config_name_resolves_from_any_directory(tmp_path, monkeypatch, bin_train):
    """`offload-train configs/13b-h200.json ...` outside the checkout reads the copy the install carries; a file
    of that name in the working directory wins; an unknown name stays what the user typed (its error names it)."""
    site = tmp_path / "site-packages"
    (site / "engine" / "configs").mkdir(parents=True)
    (site / "engine" / "configs" / "13b-h200.json").write_text("{}")
    monkeypatch.setattr(resources, "PACKAGE", site / "engine")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shipped = str(site / "engine" / "configs" / "13b-h200.json")
    assert resources.config_file("configs/13b-h200.json") == shipped
    assert resources.config_file("13b-h200.json") == shipped
    assert resources.config_file("configs/none.json") == "configs/none.json"
    assert resources.config_file("other/13b-h200.json") == "other/13b-h200.json"  # a path elsewhere: as typed
    (work / "configs").mkdir()
    (work / "configs" / "13b-h200.json").write_text("{}")
    assert resources.config_file("configs/13b-h200.json") == "configs/13b-h200.json"
    monkeypatch.undo()
    proc = bin_train("configs/13b-h200.json", "--print-config", cwd=tmp_path)  # bin/train reads the checkout's
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"]["hidden_size"] == 5120
