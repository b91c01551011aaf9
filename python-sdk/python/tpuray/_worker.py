"""``python -m tpuray._worker``: a Python worker process, started by a node agent."""

import sys

from tpuray._private.worker import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
