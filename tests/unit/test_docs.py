"""The docs site builds with every link and page checked, and the README stays a short first page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "model-repository" / "index.html").is_file()


def test_readme_is_a_short_first_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size < 12 * 1024, f"README.md is {size} bytes; the rest belongs in docs/"


def test_user_docs_speak_of_the_product_not_its_tracker():
    pages = [ROOT / "README.md", ROOT / "model_repository" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pattern = re.compile(r"\bissues? \d+|\bworkplace\b|\bhelpers?\b|\bthis session\b", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)
