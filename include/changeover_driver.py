"""Entry script of every Spark driver Changeover launches.

Shipped beside Changeover's zipped package (see `changeover.cluster.shipping`): the driver finds the package and the
job's code through --py-files, never through the checkout.
"""

import sys

from changeover.runtime.driver import main

if __name__ == "__main__":
    sys.exit(main())
