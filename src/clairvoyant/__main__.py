import sys

from clairvoyant.cli import main

sys.exit(main())
