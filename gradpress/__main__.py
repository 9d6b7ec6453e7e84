import sys

from gradpress.cli import main

sys.exit(main())
