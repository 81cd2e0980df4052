"""Writes example checkpoints (DataParallel-saved CNN, a training checkpoint, …) into a folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fixtures.make_fixtures import make_all  # noqa: E402

if __name__ == "__main__":
    made = make_all(Path(sys.argv[1] if len(sys.argv) > 1 else "example"))
    print(f"wrote {len(made)} example checkpoints into {sys.argv[1] if len(sys.argv) > 1 else 'example'}/",
          file=sys.stderr)
