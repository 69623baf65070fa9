import sys

from epd_proxy.cli import main

sys.exit(main())
