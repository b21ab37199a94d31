"""`python -m ops.cli`: the `flywheel` command."""

import sys

from ops.cli.main import main

sys.exit(main())
