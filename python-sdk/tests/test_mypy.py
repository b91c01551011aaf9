"""The Python package type-checks: mypy, configured in ``python-sdk/pyproject.toml``
(``[tool.mypy]``: the files and options), finds no error in ``python/tpuray`` (issue 22:
no type checker ran, and the stub and the package had drifted from the code)."""

import os
import subprocess
import sys

SDK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_finds_no_error_in_the_package(tmp_path):
    r = subprocess.run(
        # The cache goes to a fresh folder: a stale one from an older mypy or checkout
        # cannot hide an error.
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=900,
        # In python-sdk/, so mypy reads pyproject.toml's [tool.mypy] (the files to check).
        cwd=SDK,
        env={**os.environ, "MYPYPATH": ""},
    )
    assert r.returncode == 0, r.stdout[-12000:] + r.stderr[-2000:]
    assert "Success: no issues found" in r.stdout, r.stdout[-12000:]
