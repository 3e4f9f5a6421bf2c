"""``python -m services.localstack up|down|status``: the local stack."""

import sys

from services.localstack.stack import main

sys.exit(main())
