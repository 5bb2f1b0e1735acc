"""`python -m hybridd.bench ...`: the same command as `hybridd bench ...`."""

import sys

from hybridd.bench.cli import main

sys.exit(main())
