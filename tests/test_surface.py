"""The public surface is pinned so growth is deliberate; the README's config table is current."""

import json
import subprocess
import sys
from pathlib import Path

import engine
from engine.config.doc import render_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_public_names():
    assert sorted(engine.__all__) == [
        "Config",
        "ConfigError",
        "Engine",
        "PlannedOutOfMemoryError",
        "initialize",
        "load_config",
        "plan",
    ]


def test_schema_namespaces():
    schema = json.loads((ROOT / "schemas" / "engine.schema.json").read_text())
    assert list(schema["properties"]) == ["model", "optimizer", "train", "data", "logging", "checkpoint", "plan"]
    assert schema["additionalProperties"] is False
    assert all(s["additionalProperties"] is False for s in schema["properties"].values())


def test_readme_config_reference_is_generated_from_the_schema():
    readme = (ROOT / "README.md").read_text()
    assert render_markdown().strip() in readme
    proc = subprocess.run(
        [sys.executable, "-m", "engine.config.doc", "--check", str(ROOT / "README.md")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_states_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e . && bin/train" in readme
    assert "pip install -e '.[test]' && pytest" in readme
