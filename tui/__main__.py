"""``python -m dctms.tui PLAN``: same as the ``dctms-tui`` console script."""

import sys

from dctms.tui.app import main

sys.exit(main())
