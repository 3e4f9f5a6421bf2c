"""``python -m services.localstack up|down|status [--brokers N]``: the local stack."""

import sys

from services.localstack.cli import main

sys.exit(main())
