"""The shared test helpers (``helpers``, ``procs``, ``proxy_process``, ``dnsmasq``) live in this
folder; the tests that use them live in the folders that mirror the package."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
