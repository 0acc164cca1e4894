"""`python -m app` is the `kvstore` command."""

import sys

from app.cli import main

sys.exit(main())
