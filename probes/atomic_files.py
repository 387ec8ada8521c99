"""Cache files written beside their final path and renamed into place.

More than one process may fill the same cache entry at once (a worker's retention check and
an offline evaluation fetching one dataset, `make test` running modules in parallel): each
writes a side file of its own, so none renames another's half-written file away, and the
rename makes a reader see either nothing or the whole file.
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def side_path(target: Path, suffix: str = "") -> Path:
    """A sibling of `target` no other process uses (same folder: the rename stays atomic).

    `suffix` for writers that insist on an extension (numpy's savez appends ".npz" otherwise)."""
    return target.with_name(f"{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial{suffix}")


@contextmanager
def replacing(target: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a side path to write `target`'s new content to: renamed onto `target` when the
    block ends, removed if it raises (an interrupted write leaves nothing behind)."""
    side = side_path(target, suffix)
    try:
        yield side
        side.replace(target)
    except BaseException:
        side.unlink(missing_ok=True)
        raise
