import sys

from ppokit.cli import main

sys.exit(main())
