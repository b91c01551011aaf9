"""Values to bytes and back: cloudpickle (protocol 5), with the object refs nested in a
value captured while it is pickled, so the core worker keeps them alive for as long as
the value lives (CORE-2) and a process that unpickles one registers as its borrower.

Large buffers (numpy arrays and anything else that pickles through ``PickleBuffer``) go
out of band: a value with such buffers is serialized as ::

    [header: magic, pickle length, buffer count, (offset, length) per buffer]
    [pickle bytes]
    [each buffer, at an offset that is a multiple of 64]

in pieces that the extension writes straight into the object store, and read back with
each buffer a read-only view of the bytes it was given (for a store object, of the
shared-memory mapping itself: no copy, Ray's behaviour). Values without such buffers are
plain pickle bytes, as before.

Buffers go out of band from 1 KiB up (``OUT_OF_BAND_MIN_BYTES``); the pieces are written
with ``raw::put_parts``.
"""

from __future__ import annotations

import pickle
import struct
import threading

import cloudpickle

from tpuray import _tpuray

_capture = threading.local()


class ObjectRef:
    """A reference to an object in the cluster (Ray's ``ObjectRef``).

    Pass it to tasks (top-level arguments are replaced by their values before the task
    runs; refs nested in other values stay refs), ``get`` it, or ``await`` it inside an
    async actor.
    """

    __slots__ = ("_core", "__weakref__")

    def __init__(self, core):
        self._core = core

    def hex(self) -> str:
        """The object id as 32 hex characters."""
        return self._core.id()

    def binary(self) -> bytes:
        return bytes.fromhex(self._core.id())

    def task_id(self) -> str:
        return self._core.id()[:-8]

    def owner_address(self) -> str:
        return self._core.owner()

    def __reduce__(self):
        nested = getattr(_capture, "refs", None)
        if nested is not None:
            nested.append(self._core)
        return (_rebuild_ref, (self._core.id(), self._core.owner()))

    def __hash__(self) -> int:
        return hash(self._core.id())

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectRef) and other._core.id() == self._core.id()

    def __repr__(self) -> str:
        return f"ObjectRef({self._core.id()})"

    def future(self):
        """A ``concurrent.futures.Future`` resolved with the value."""
        import concurrent.futures

        from tpuray._private import worker

        fut: concurrent.futures.Future = concurrent.futures.Future()

        def resolve():
            try:
                fut.set_result(worker.get(self))
            except BaseException as e:  # noqa: BLE001 - handed to the future
                fut.set_exception(e)

        threading.Thread(target=resolve, daemon=True).start()
        return fut

    def __await__(self):
        import asyncio

        return asyncio.wrap_future(self.future()).__await__()


class ObjectRefGenerator:
    """The refs of a streaming task's items (Ray's ``ObjectRefGenerator``), in the order
    produced: ``for ref in gen: ray.get(ref)``, or ``async for ref in gen`` in async
    code. ``next`` blocks until the next item exists. When the task raises, the item
    after the last one produced is a ref whose ``get`` raises the error, and the
    generator then ends (Ray 2.60's streaming generators). ``ray.wait([gen])`` counts it
    ready once its next item (or its end) is there; ``ray.cancel(gen)`` cancels the task.
    """

    def __init__(self, task_id: str, name: str):
        self._task_id = task_id
        self._name = name
        self._next = 0
        self._done = False

    def __iter__(self):
        return self

    def __next__(self) -> ObjectRef:
        if self._done:
            raise StopIteration
        r = _tpuray.next_item(self._task_id, self._name, self._next)
        if r is None:
            self._done = True
            raise StopIteration
        self._next += 1
        return ObjectRef(r)

    def __aiter__(self):
        return self

    async def __anext__(self) -> ObjectRef:
        """The next item's ref without blocking the event loop (waits on a thread)."""
        import asyncio

        if self._done:
            raise StopAsyncIteration
        if _tpuray.generator_ready(self._task_id, self._next):
            r = _tpuray.next_item(self._task_id, self._name, self._next)
        else:
            r = await asyncio.get_running_loop().run_in_executor(
                None, _tpuray.next_item, self._task_id, self._name, self._next
            )
        if r is None:
            self._done = True
            raise StopAsyncIteration
        self._next += 1
        return ObjectRef(r)

    def _next_ready(self) -> bool:
        """Whether ``next`` would return at once (an item or the end is there)."""
        return self._done or _tpuray.generator_ready(self._task_id, self._next)

    def next_ready(self) -> bool:
        """Whether the next item is there (Ray's ``ObjectRefGenerator.next_ready``)."""
        return self._next_ready()

    def is_finished(self) -> bool:
        """Whether every item was taken and the task ended (Ray's ``is_finished``)."""
        return self._done

    def __del__(self):
        try:
            _tpuray.drop_stream(self._task_id, self._next)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"ObjectRefGenerator({self._task_id})"


def _rebuild_ref(object_id: str, owner: str) -> ObjectRef:
    return ObjectRef(_tpuray.deserialize_ref(object_id, owner))


#: In every pickle with a ref inside: the name of the function that rebuilds it.
_REF_MARK = _rebuild_ref.__name__.encode()


#: Values the C pickler handles the same way cloudpickle does (no code, no refs inside).
_PLAIN = (int, float, str, bytes, bool, type(None))
_NO_REFS: list = []

#: The first bytes of a value with out-of-band buffers (a pickle starts with 0x80).
_MAGIC = b"TPRAYOB1"
#: magic, pickle length, buffer count; then one (offset, length) per buffer.
_HEAD = struct.Struct("<8sQQ")
_ENTRY = struct.Struct("<QQ")
#: Buffers start at multiples of this (from the start of the object, which a mapping
#: places on a page boundary): a cache line, and enough for any numpy dtype or SIMD load.
_ALIGN = 64
_PAD = bytes(_ALIGN)
#: Buffers smaller than this stay inside the pickle (copied, like any other value).
OUT_OF_BAND_MIN_BYTES = 1024


def serialize_parts(value) -> tuple[list, list]:
    """Pickles ``value`` into pieces whose concatenation is its serialized form: plain
    pickle bytes, or the layout in the module docstring with large buffers as views of
    the value's own memory (not copied). Returns the pieces and the refs nested in it
    (core handles).

    Raises:
        TypeError: the value (or something inside it) cannot be pickled; the message
            names its type.
    """
    if type(value) in _PLAIN:
        return [pickle.dumps(value, protocol=5)], _NO_REFS
    buffers: list = []

    def out_of_band(pb) -> bool:
        # False: out of band (appended here); True: inside the pickle stream.
        try:
            raw = pb.raw()
        except BufferError:  # not contiguous: pickle copies it in band
            return True
        if raw.nbytes < OUT_OF_BAND_MIN_BYTES:
            return True
        buffers.append(raw)
        return False

    prev = getattr(_capture, "refs", None)
    _capture.refs = []
    try:
        data = cloudpickle.dumps(value, protocol=5, buffer_callback=out_of_band)
        refs = _capture.refs
    except Exception as e:  # noqa: BLE001 - re-raised with the offending object named
        raise TypeError(
            f"could not serialize {type(value).__name__} object {_short_repr(value)}: {e}"
        ) from e
    finally:
        _capture.refs = prev
    if not buffers:
        return [data], refs
    offset = _HEAD.size + _ENTRY.size * len(buffers) + len(data)
    entries = [_HEAD.pack(_MAGIC, len(data), len(buffers))]
    parts = [None, data]
    for b in buffers:
        pad = -offset % _ALIGN
        if pad:
            parts.append(_PAD[:pad])
            offset += pad
        entries.append(_ENTRY.pack(offset, b.nbytes))
        parts.append(b)
        offset += b.nbytes
    parts[0] = b"".join(entries)
    return parts, refs


def serialize(value) -> tuple[bytes, list]:
    """Pickles ``value``; returns the bytes (see :func:`serialize_parts`) and the refs
    nested in it (core handles).

    Raises:
        TypeError: the value (or something inside it) cannot be pickled; the message
            names its type.
    """
    parts, refs = serialize_parts(value)
    return (parts[0] if len(parts) == 1 else b"".join(parts)), refs


def deserialize(data):
    """Unpickles what :func:`serialize` made, from bytes or any bytes-like object (a
    mapped store object): out-of-band buffers come back as read-only views of ``data``,
    which they keep alive. Refs inside become borrowed refs, registered with their owners
    in one call per owner before this returns (CORE-2)."""
    if type(data) is bytes and not data.startswith(_MAGIC) and _REF_MARK not in data:
        # No ref inside (each pickled ref names _rebuild_ref): no borrow batch to open.
        return pickle.loads(data)
    _tpuray.begin_borrow_batch()
    try:
        if data[: len(_MAGIC)] != _MAGIC:
            return pickle.loads(data)
        view = memoryview(data)
        _, size, count = _HEAD.unpack_from(view)
        start = _HEAD.size + _ENTRY.size * count
        buffers = [view[o : o + n] for o, n in _ENTRY.iter_unpack(view[_HEAD.size : start])]
        return pickle.loads(view[start : start + size], buffers=buffers)
    finally:
        _tpuray.end_borrow_batch()


def mapped_view(buf) -> memoryview:
    """A read-only memoryview of a store object the extension mapped (an
    ``ObjectBuffer``); it and every view or array made from it keep the mapping alive."""
    import ctypes

    size = len(buf)
    if size == 0:
        return memoryview(b"")
    exporter = (ctypes.c_char * size).from_address(buf.address())
    # The ctypes array only points at the mapping; it owns the ObjectBuffer, and every
    # memoryview made from it (slices included) owns the array.
    setattr(exporter, "_tpuray_object", buf)
    return memoryview(exporter).cast("B").toreadonly()


def _short_repr(value) -> str:
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        r = object.__repr__(value)
    return r if len(r) <= 80 else r[:77] + "..."
