# Finds mpx_torch where tests/torch/run.sh builds it (build-torch/lib) when it is not
# installed, and shares the helpers of both test files.
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[2]
try:
    import mpx_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(root / "build-torch" / "lib"))
