"""``python -m gradest``: the ``gradest`` command line (:mod:`gradest.cli`)."""

import sys

from gradest.cli import main

if __name__ == "__main__":
    sys.exit(main())
