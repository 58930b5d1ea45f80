import sys

from deepspeed_ext.cli import main

sys.exit(main())
