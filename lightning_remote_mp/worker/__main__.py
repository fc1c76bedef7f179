import sys

from lightning_remote_mp.worker.cli import main

sys.exit(main())
