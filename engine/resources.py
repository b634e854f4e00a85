"""Where the files the package reads at run time lie: the schema, the shipped configs, the C source.

schemas/ and configs/ are top-level folders of the checkout (the sources of truth); pyproject.toml ships them
inside the wheel as engine/schemas and engine/configs, so an installed package reads its own copy from any
working directory. The package's own folder is looked at first, so a wheel never reads a stray top-level
`schemas/` beside it in site-packages.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def data_path(folder: str, name: str) -> Path:
    """`folder/name` inside the installed package, else beside the package in a checkout."""
    candidates = (PACKAGE / folder / name, PACKAGE.parent / folder / name)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{folder}/{name} is missing from this install (looked at {candidates[0]} and {candidates[1]}): "
        "reinstall offload-engine with `pip install .` from a checkout, or run from the checkout"
    )


def config_file(name: str) -> str:
    """A config path as given, or, when no such file exists here, the shipped config of that name
    (`configs/13b-h200.json` or `13b-h200.json`) from the install, so the README's commands work anywhere."""
    given = Path(name)
    if given.exists() or given.suffix != ".json" or given.parent not in (Path("."), Path("configs")):
        return name
    shipped = (PACKAGE / "configs" / given.name, PACKAGE.parent / "configs" / given.name)
    return str(next((path for path in shipped if path.is_file()), name))
