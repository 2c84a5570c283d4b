"""tests/gpu/ sees the float64 references of tests/reference.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
