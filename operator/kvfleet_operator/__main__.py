"""``python -m kvfleet_operator`` == ``kvfleet-operator``."""
import sys

from .cli import main

sys.exit(main())
