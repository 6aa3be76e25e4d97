import sys

from regen.cli import main

sys.exit(main())
