"""``python -m services.scheduler``: the deadline scheduler until SIGINT/SIGTERM; settings come
from ``SANDSTREAM_*`` variables."""

from services.common.entrypoint import run_until_signalled
from services.scheduler.scheduler import serve

run_until_signalled(serve)
