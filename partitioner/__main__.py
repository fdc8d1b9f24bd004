import sys

from partitioner.cli import main

sys.exit(main())
