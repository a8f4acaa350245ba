"""``python -m tests.exactness``: see :mod:`tests.exactness.runner`."""

import sys

from tests.exactness.runner import main

sys.exit(main())
