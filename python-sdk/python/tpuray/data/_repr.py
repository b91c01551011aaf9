"""``repr(Dataset)`` as Ray 2.60 prints it (``Dataset.__repr__`` in
``ray/data/dataset.py`` and ``ray/data/_internal/dataset_repr.py``), computed without
running the pipeline:

- when the dataset's schema is known without running anything (a materialized dataset,
  ``range``, and operators that keep or project it: ``filter``, ``limit``,
  ``random_shuffle``, ``repartition``, ``sort``, ``select_columns``), a table::

      shape: (ROWS or ?, COLUMNS)
      ╭───────╮
      │ id    │
      │ ---   │
      │ int64 │
      ╰───────╯
      (Dataset isn't materialized)

  where a materialized dataset also shows its rows (all of them up to 10, else the first
  5, a ``…`` row and the last 5; cells cut to 40 characters) and ends with ``(Showing K of
  N rows)``;
- otherwise the plan, newest operator first, one ``+- `` level per operator (3 spaces of
  indent each), ending with the source's line ``Dataset(num_rows=N, schema={id: int64})``
  (``?`` / ``Unknown schema`` when unknown; split over lines past 80 characters).
"""

from __future__ import annotations

from typing import Optional

from tpuray.data import block as B

_ELLIPSIS = "…"
_MAX_ROWS = 10
_HEAD_ROWS = 5
_MAX_CELL = 40
_LINE_LIMIT = 80
_INDENT = "   "


def _source_info(ds):
    """``(names, type strings, rows)`` of the source; names None when unknown."""
    src = ds._source
    if src.blocks:
        rows = sum(m.num_rows for _, m in src.blocks)
        for ref, m in src.blocks:
            if m.num_rows:
                import tpuray

                t = B.to_arrow(tpuray.get(ref))
                return t.column_names, [str(f.type) for f in t.schema], rows
        return None, None, rows
    known = getattr(src, "known_schema", None)
    names, types = known if known else (None, None)
    return names, types, getattr(src, "known_rows", None)


def _op_effect(lg):
    """How an operator changes ``(schema, rows)``: ``"keep"`` (both), ``"schema"`` (keeps
    the schema, rows unknown), ``("limit", n)``, ``("project", cols)``, or None (both
    unknown)."""
    if "project" in lg.kw:
        return ("project", list(lg.kw["project"]))
    if lg.kind == "limit":
        return ("limit", lg.kw["limit"])
    if lg.kind == "all_to_all" and (lg.kw.get("how") or ("",))[0] in ("shuffle", "repartition", "sort"):
        return "keep"
    if lg.name.startswith("Filter("):
        return "schema"
    return None


def _known(ds):
    """``(names, types, rows)`` after every operator, names None when unknown."""
    names, types, rows = _source_info(ds)
    for lg in ds._ops:
        eff = _op_effect(lg)
        if eff is None:
            return None, None, None
        if names is None:
            return None, None, None
        if eff == "schema":
            rows = None
        elif eff[0] == "limit":
            rows = None if rows is None else min(rows, eff[1])
        elif eff[0] == "project":
            cols = eff[1]
            if any(c not in names for c in cols):
                return None, None, None
            types = [types[names.index(c)] for c in cols]
            names = cols
    return names, types, rows


def _plan_name(lg) -> str:
    if lg.kind == "limit":
        return f"limit={lg.kw['limit']}"
    if lg.kind == "all_to_all" and lg.name.startswith("Sort("):
        return "Sort"
    return lg.name


def dataset_repr(ds) -> str:
    from tpuray.data.dataset import MaterializedDataset

    materialized = isinstance(ds, MaterializedDataset)
    names, types, rows = _known(ds)
    if names:
        return _table(ds, names, types, rows, materialized)
    return _summary(ds, materialized)


def _cell(v) -> str:
    s = str(v).replace("\n", " ").replace("\r", " ")
    return s if len(s) <= _MAX_CELL else s[:_MAX_CELL - 1] + _ELLIPSIS


def _preview(ds, names, rows):
    """The head and tail rows to show of a materialized dataset, as cell strings."""
    import tpuray

    if rows is None or rows <= _MAX_ROWS:
        head_n, tail_n = (rows if rows is not None else _MAX_ROWS), 0
    else:
        head_n, tail_n = _HEAD_ROWS, _MAX_ROWS - _HEAD_ROWS
    blocks = [(ref, m) for ref, m in ds._source.blocks if m.num_rows]
    head = []
    for ref, _ in blocks:
        if len(head) >= head_n:
            break
        for r in B.rows(tpuray.get(ref)):
            head.append(r)
            if len(head) >= head_n:
                break
    tail: list = []
    for ref, m in reversed(blocks):
        if len(tail) >= tail_n:
            break
        need = tail_n - len(tail)
        block = tpuray.get(ref)
        part = list(B.rows(B.slice_block(block, max(0, m.num_rows - need), m.num_rows)))
        tail = part + tail
    fmt = lambda rs: [[_cell(r.get(c)) for c in names] for r in rs]  # noqa: E731
    return fmt(head), fmt(tail)


def _table(ds, names, types, rows, materialized) -> str:
    head, tail = _preview(ds, names, rows) if materialized else ([], [])
    headers = [_cell(n) for n in names]
    dtypes = [_cell(t) for t in types]
    seps = ["---"] * len(names)
    body = head + ([[_ELLIPSIS] * len(names)] if head and tail else []) + tail
    widths = [max(len(r[i]) for r in [headers, dtypes, seps] + body) for i in range(len(names))]

    def border(left, mid, right, fill):
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def line(cells):
        return "│" + "┆".join(f" {c.ljust(w)} " for c, w in zip(cells, widths)) + "│"

    out = [f"shape: ({'?' if rows is None else rows}, {len(names)})",
           border("╭", "┬", "╮", "─"), line(headers), line(seps), line(dtypes)]
    if body:
        out.append(border("╞", "╪", "╡", "═"))
        out += [line(r) for r in body]
    out.append(border("╰", "┴", "╯", "─"))
    if materialized:
        out.append(f"(Showing {len(head) + len(tail)} of {'?' if rows is None else rows} rows)")
    else:
        out.append("(Dataset isn't materialized)")
    return "\n".join(out)


def _summary(ds, materialized) -> str:
    plan = [_plan_name(lg) for lg in reversed(ds._ops)]
    depth = len(plan)
    names, types, rows = _source_info(ds)
    schema = "Unknown schema" if names is None else \
        "{" + ", ".join(f"{n}: {t}" for n, t in zip(names, types)) + "}"
    cls = type(ds).__name__
    num_blocks: Optional[int] = len(ds._source.blocks) if materialized else None
    count = "?" if rows is None else rows
    blocks_str = f"num_blocks={num_blocks}, " if num_blocks else ""
    text = f"{cls}({blocks_str}num_rows={count}, schema={schema})"
    pad = _INDENT * depth
    if len(text) > _LINE_LIMIT:
        if len(f"{pad}{_INDENT}schema={schema}") > _LINE_LIMIT and names is not None:
            cols = []
            for n, t in zip(names, types):
                col = f"{pad}{_INDENT * 2}{n}: {t}"
                if len(col) > _LINE_LIMIT:
                    suffix = f"...: {t}"
                    col = col[:max(_LINE_LIMIT - len(suffix), 10)] + suffix
                cols.append(col)
            schema = "{\n" + ",\n".join(cols) + f"\n{pad}{_INDENT}" + "}"
        blocks_line = f"\n{pad}{_INDENT}num_blocks={num_blocks}," if num_blocks else ""
        text = (f"{cls}({blocks_line}\n{pad}{_INDENT}num_rows={count},"
                f"\n{pad}{_INDENT}schema={schema}\n{pad})")
    lines = []
    for i, name in enumerate(plan):
        lines.append(name if i == 0 else f"{_INDENT * (i - 1)}+- {name}")
    if depth == 0:
        return text
    return "\n".join(lines) + "\n" + f"{_INDENT * (depth - 1)}+- {text}"
