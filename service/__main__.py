"""`python -m service serve ...`: the `jaxserve` command (service.cli) without the console script."""

import sys

from service.cli import main

sys.exit(main())
