"""The OpenAPI document, checked in as docs/openapi.json so that any change to the API's
surface is a reviewed diff (a test fails while the file is stale).

    python -m services.api.openapi_export            # (re)write docs/openapi.json
    python -m services.api.openapi_export --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Final, cast

from services.api.app import create_app
from services.common.settings import PROJECT_ROOT, Settings
from services.common.tokens import TokenStore

CHECKED_IN: Final = PROJECT_ROOT / "docs" / "openapi.json"


def render() -> str:
    # The document depends on the routes only: no pool, publisher or tokens are used.
    app = create_app(Settings(), cast(Any, None), cast(Any, None), TokenStore.of())
    return json.dumps(app.openapi(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.api.openapi_export")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not CHECKED_IN.exists() or CHECKED_IN.read_text() != text
        if stale:
            print("docs/openapi.json is stale: run python -m services.api.openapi_export",
                  file=sys.stderr)  # fmt: skip
        return 1 if stale else 0
    CHECKED_IN.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
