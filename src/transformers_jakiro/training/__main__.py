"""`python -m transformers_jakiro.training ...` and `accelerate launch -m transformers_jakiro.training ...`."""

import sys

from .cli import main

sys.exit(main())
