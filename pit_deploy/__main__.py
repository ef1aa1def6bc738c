"""``python -m pit_deploy`` is the same as the ``pit-deploy`` command."""

import sys

from .cli import main

sys.exit(main())
