"""``python -m services.executor``: executor, watcher and reconciler with the driver the
settings name (``SANDSTREAM_DRIVER``) until SIGINT/SIGTERM; settings come from ``SANDSTREAM_*``
variables."""

from services.common.entrypoint import run_until_signalled
from services.executor.driver_side import serve_driver_side

run_until_signalled(serve_driver_side)
