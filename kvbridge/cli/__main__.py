"""``python -m kvbridge.cli``: the ``kvbridge`` command without its console script, as the tests
and a clone without an install run it."""

import sys

from kvbridge.cli import main

sys.exit(main())
