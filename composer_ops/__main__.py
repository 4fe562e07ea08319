"""``python -m composer_ops`` is ``composer-ops``."""

import sys

from composer_ops.cli import main

sys.exit(main())
