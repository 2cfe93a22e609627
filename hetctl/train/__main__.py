"""``python -m hetctl.train``: run one rank of the reference pipeline trainer."""

import sys

from hetctl.train.main import main

sys.exit(main())
