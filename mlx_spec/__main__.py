import sys

from mlx_spec.cli import main

sys.exit(main())
