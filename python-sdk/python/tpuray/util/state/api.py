"""Ray's ``ray.util.state.api`` module path: the functions live in ``tpuray.util.state``."""

from tpuray.util.state import *  # noqa: F401,F403
from tpuray.util.state import __all__  # noqa: F401
