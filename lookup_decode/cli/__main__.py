import sys

from lookup_decode.cli.commands import main

sys.exit(main())
