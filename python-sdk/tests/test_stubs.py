"""The extension's type stubs (``tpuray/_tpuray.pyi``) match the compiled module:
mypy's ``stubtest`` imports ``tpuray._tpuray`` and compares every name, parameter
name, default and class against the stub, so a binding changed in
``python-sdk/src/lib.rs`` without its stub fails here (issue 22: the stub had drifted
with no type checker running)."""

import os
import subprocess
import sys


def test_stubtest_finds_the_stub_and_the_compiled_module_alike(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "tpuray._tpuray"],
        capture_output=True,
        text=True,
        timeout=600,
        # Outside the checkout, so the installed package (with its compiled module) is
        # what is checked, not the source folder.
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": ""},
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Success" in r.stdout, r.stdout
