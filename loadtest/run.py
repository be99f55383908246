#!/usr/bin/env python3
"""Run the load-test comparison (plain separate calls vs the integrated ensemble) and write the report.

    .venv/bin/python loadtest/run.py                      # make loadtest: tiny config, CPU
    .venv/bin/python loadtest/run.py --config full        # make loadtest-full
    .venv/bin/python loadtest/run.py --help               # every option

A thin command line over :mod:`cosyvoice_triton.loadtest.runner`; see loadtest/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyvoice_triton.loadtest.runner import main

if __name__ == "__main__":
    sys.exit(main())
