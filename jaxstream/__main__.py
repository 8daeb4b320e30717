import sys

from jaxstream.cli import main

sys.exit(main())
