"""``python -m numatp`` runs the command line."""

import sys

from numatp.cli import main

sys.exit(main())
