"""`python -m buffer serve --config X.yaml` and `python -m buffer keygen DIR`."""
import sys

from buffer.server import main

sys.exit(main(sys.argv[1:]))
