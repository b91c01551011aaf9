"""Internals of the tpuray Python SDK; not a public API."""
