"""``python -m tilemm``: the demo (``python -m tilemm.demo``): quantize, multiply, check against fp32."""

import sys

from .demo import main

sys.exit(main(prog="python -m tilemm"))
