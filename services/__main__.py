"""``python -m services`` is the ``tandem`` command."""

import sys

from services.cli import main

sys.exit(main())
