"""``python -m fullthrottle``: the ``fullthrottle`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
