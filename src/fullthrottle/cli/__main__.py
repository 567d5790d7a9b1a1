"""``python -m fullthrottle.cli``."""

import sys

from . import main

sys.exit(main())
