import sys

from epd_proxy.sim.cli import main

sys.exit(main())
