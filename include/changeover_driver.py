"""Entry script of every Spark driver Changeover launches.

It lives at the top of include/ because spark-submit puts the script's folder on sys.path,
and that folder must not shadow top-level packages such as `jobs`.
"""

import sys

from changeover.driver import main

if __name__ == "__main__":
    sys.exit(main())
