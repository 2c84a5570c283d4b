"""``python -m entropy_discriminator.adapters.openrlhf``: the launcher (see :mod:`._launch`).

Without a supported OpenRLHF installed (``--help`` included, which goes to OpenRLHF's own CLI),
it prints one line saying which releases it needs and exits with status 2, without a traceback.
"""

import sys

from ._launch import main
from ._patch import UnsupportedVersionError

try:
    main()
except UnsupportedVersionError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
