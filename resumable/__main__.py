import sys

from resumable.cli import main

sys.exit(main())
