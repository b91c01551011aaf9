"""numpy arrays through the object store, as on Ray: a large array that is put or
returned comes back equal, read-only and backed by the node's shared-memory store (the
mapping itself, no copy); arrays nested in dicts and lists too; everything else pickles
as before. The serialization layout is checked here directly; the store paths run in
driver scripts against a two-node cluster started with the CLI (``init`` is once per
process, and the other modules of the suite hold this one's)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

np = pytest.importorskip("numpy")

from tpuray._private import serialization  # noqa: E402 - after the numpy check

CLI = [sys.executable, "-m", "tpuray"]

#: Helpers every script gets: where an array's memory comes from.
PRELUDE = """
    import numpy as np
    import tpuray as ray
    from tpuray import _tpuray

    def store_buffer(arr):
        '''The ObjectBuffer (mapped store object) an array's memory belongs to, or None.'''
        base = arr
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if not isinstance(base, memoryview):
            return None
        buf = getattr(base.obj, "_tpuray_object", None)
        if not isinstance(buf, _tpuray.ObjectBuffer):
            return None
        start, addr = buf.address(), arr.__array_interface__["data"][0]
        assert start <= addr and addr + arr.nbytes <= start + len(buf), "outside the mapping"
        return buf

    def check_zero_copy(arr, expected):
        assert isinstance(arr, np.ndarray), type(arr)
        assert arr.dtype == expected.dtype and arr.shape == expected.shape
        assert np.array_equal(arr, expected)
        assert not arr.flags.writeable, "arrays from the store are read-only"
        assert store_buffer(arr) is not None, "not backed by the store's mapping"
        assert arr.__array_interface__["data"][0] % 64 == 0, "buffer not 64-byte aligned"
        try:
            arr[0] = 1
        except ValueError as e:
            assert "read-only" in str(e), e
        else:
            raise AssertionError("writing to an array from the store must fail")
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head node and a second node (resource ``other``) on this machine, each with its
    own store; yields ``(address, env, tmp)``."""
    tmp = tmp_path_factory.mktemp("numpy")
    env = dict(os.environ)
    env["HOME"] = str(tmp / "home")
    env["TPURAY_REGISTRY_DIR"] = str(tmp / "registry")
    env.pop("TPURAY_ADDRESS", None)
    os.makedirs(env["HOME"], exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"

    def start(args):
        r = subprocess.run(CLI + ["start", *args], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

    try:
        start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2", "--temp-dir", str(tmp / "head")])
        start(["--address", addr, "--num-cpus", "1", "--resources", '{"other": 1}',
               "--temp-dir", str(tmp / "other")])
        yield addr, env, tmp
    finally:
        subprocess.run(CLI + ["stop"], env=env, capture_output=True, timeout=120)


def run_script(two_nodes, body: str, timeout: float = 180) -> str:
    """Runs ``PRELUDE + body`` as a driver of the cluster; fails with its output unless
    it exits 0. Returns stdout."""
    addr, env, tmp = two_nodes
    script = tmp / "script.py"
    script.write_text(textwrap.dedent(PRELUDE) + f"ray.init({addr!r})\n" + textwrap.dedent(body)
                      + "ray.shutdown()\n")
    r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# ---- the layout, without a cluster ----


def test_large_buffers_go_out_of_band_at_aligned_offsets():
    a = np.arange(100_000, dtype=np.float64)
    b = np.ones((300, 7), dtype=np.int8)  # 2100 bytes: out of band, at an odd offset
    small = np.arange(10)  # under OUT_OF_BAND_MIN_BYTES: inside the pickle
    parts, refs = serialization.serialize_parts({"a": a, "b": [b, small], "s": "x"})
    assert refs == []
    data = b"".join(parts)
    assert data.startswith(serialization._MAGIC)
    _, _, count = serialization._HEAD.unpack_from(data)
    assert count == 2
    entries = list(serialization._ENTRY.iter_unpack(
        data[serialization._HEAD.size: serialization._HEAD.size + 16 * count]))
    assert [n for _, n in entries] == [a.nbytes, b.nbytes]
    assert all(o % 64 == 0 for o, _ in entries)
    # The big buffers are views of the arrays themselves, not copies.
    addr = a.__array_interface__["data"][0]
    assert any(isinstance(p, memoryview) and np.frombuffer(p, np.uint8).ctypes.data == addr
               for p in parts)
    out = serialization.deserialize(data)
    assert np.array_equal(out["a"], a) and np.array_equal(out["b"][0], b)
    assert np.array_equal(out["b"][1], small) and out["s"] == "x"
    assert not out["a"].flags.writeable
    assert out["b"][1].flags.writeable  # copied out of the pickle


def test_layouts_numpy_pickles_in_band_still_round_trip():
    base = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    values = [
        np.asfortranarray(base),  # F-contiguous: out of band as well
        base[::2, ::3],  # not contiguous: copied into the pickle
        np.array(3.5),  # 0-d
        np.array(["a", None, 3], dtype=object),  # object arrays pickle their items
        np.zeros(0),
        np.arange(5000, dtype=">i4"),  # byte order kept
    ]
    for v in values:
        out = serialization.deserialize(serialization.serialize(v)[0])
        assert out.dtype == v.dtype and out.shape == v.shape
        assert np.array_equal(out, v) if v.dtype != object else list(out) == list(v)
        assert out.flags.f_contiguous == v.flags.f_contiguous or v.ndim < 2


def test_values_without_buffers_are_plain_pickles():
    for v in [1, "s", b"x" * 200_000, bytearray(b"y" * 5000), {"k": [1, 2.5, None]}]:
        data, _ = serialization.serialize(v)
        assert data.startswith(b"\x80\x05")
        out = serialization.deserialize(data)
        assert out == v and type(out) is type(v)


# ---- through the store ----


def test_put_array_comes_back_read_only_from_the_store_mapping(two_nodes):
    run_script(two_nodes, """
        arr = np.random.default_rng(0).standard_normal(50 * 2**20 // 8)  # 50 MB
        ref = ray.put(arr)
        got = ray.get(ref)
        check_zero_copy(got, arr)
        again = ray.get(ref)
        check_zero_copy(again, arr)
        # The array keeps the mapping alive on its own.
        view = ray.get(ref)[1000:2000]
        del ref
        import gc; gc.collect()
        assert np.array_equal(view, arr[1000:2000])
        # A copy is an ordinary writable array.
        c = got.copy(); c[0] = 1.0
    """)


def test_task_returns_and_arguments_with_large_arrays(two_nodes):
    run_script(two_nodes, """
        @ray.remote
        def make(n):
            return np.arange(n, dtype=np.int64)

        @ray.remote
        def total(a):
            assert not a.flags.writeable
            return int(a.sum())

        n = 50 * 2**20 // 8
        expected = np.arange(n, dtype=np.int64)
        r = make.remote(n)
        check_zero_copy(ray.get(r), expected)
        assert ray.get(total.remote(r)) == int(expected.sum())  # a ref argument
        assert ray.get(total.remote(expected)) == int(expected.sum())  # a value argument
        # An actor method's return, and a second node reading an object of the first.
        @ray.remote
        class Holder:
            def __init__(self):
                self.a = np.full(3 * 2**20, 7, dtype=np.uint8)
            def get(self):
                return self.a

        h = Holder.remote()
        check_zero_copy(ray.get(h.get.remote()), np.full(3 * 2**20, 7, dtype=np.uint8))

        @ray.remote(resources={"other": 1})
        def remote_total(box):
            (ref,) = box
            a = ray.get(ref)
            assert not a.flags.writeable
            return int(a.sum())

        big = ray.put(expected)
        assert ray.get(remote_total.remote([big])) == int(expected.sum())
    """)


def test_arrays_nested_in_dicts_and_lists(two_nodes):
    run_script(two_nodes, """
        a = np.arange(2**20, dtype=np.float32)
        b = np.ones((512, 512), dtype=np.int16, order="F")
        small = np.arange(4)
        value = {"a": a, "inner": [b, small, "text", {"again": a}], "t": (a[:1000], 3)}
        inner_ref = ray.put(np.arange(10))

        @ray.remote
        def echo(v):
            return v

        for got in (ray.get(ray.put(value)), ray.get(echo.remote(value))):
            check_zero_copy(got["a"], a)
            check_zero_copy(got["inner"][0], b)
            assert got["inner"][0].flags.f_contiguous
            assert np.array_equal(got["inner"][1], small)
            assert got["inner"][2] == "text"
            check_zero_copy(got["inner"][3]["again"], a)
            assert np.array_equal(got["t"][0], a[:1000]) and got["t"][1] == 3
        boxed = ray.get(ray.put({"arr": a, "ref": inner_ref}))
        check_zero_copy(boxed["arr"], a)
        assert isinstance(boxed["ref"], ray.ObjectRef)
        assert np.array_equal(ray.get(boxed["ref"]), np.arange(10))
    """)


def test_objects_without_arrays_are_unchanged(two_nodes):
    run_script(two_nodes, """
        import collections
        Point = collections.namedtuple("Point", "x y")
        values = [
            b"z" * (3 * 2**20),
            bytearray(b"w" * (2 * 2**20)),
            "s" * 500_000,
            list(range(200_000)),
            {"p": Point(1, 2), "f": 1.5, "n": None},
            42,
        ]

        @ray.remote
        def echo(v):
            return v

        for v in values:
            for got in (ray.get(ray.put(v)), ray.get(echo.remote(v))):
                assert got == v and type(got) is type(v), (type(got), type(v))
        ba = ray.get(ray.put(bytearray(b"q" * 300_000)))
        ba[0] = 1  # a bytearray stays a writable bytearray
    """)
