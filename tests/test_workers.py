"""The suite runs in two pytest-xdist processes (pyproject's addopts). Tests that start
mlx.launch ranks bind the ring backend's ports, so tests/conftest.py sends every file that
does to one worker; a file missing from its list would collide with the others."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import RING_FILES

HERE = Path(__file__).parent
# An mlx.launch (the tool itself, or `mlx-spec launch -n N`) started from a test file.
STARTS_RANKS = re.compile(r'"mlx\.launch"|"launch", "-n"')


def test_every_file_that_starts_ranks_runs_on_the_ring_worker():
    starting = {p.name for p in HERE.glob("test_*.py")
                if p.name != Path(__file__).name and STARTS_RANKS.search(p.read_text())}
    assert {"test_distributed.py", "test_dist_serve.py"} <= starting  # the pattern finds them
    assert starting <= set(RING_FILES), f"add {sorted(starting - set(RING_FILES))} to RING_FILES"
