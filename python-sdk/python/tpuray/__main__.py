"""``python -m tpuray``: the same as the ``tpuray`` console script."""

from tpuray import _cli

if __name__ == "__main__":
    _cli.main()
