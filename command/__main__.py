"""``python -m loraserve``: the ``loraserve`` command line."""

import sys

from loraserve.cli import main

sys.exit(main())
