"""The commands of the README's set-up section (its ```bash blocks, in order).

    python3 .ci/readme_commands.py              print them, one per line
    python3 .ci/readme_commands.py --check A B  exit 1 (showing them) unless the first is A
                                                and B is one of them

.ci/run checks its own copies with --check before running them, so that CI runs what the
README tells a newcomer to paste; tests/test_setup_docs.py does the same. Standard
library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Set-up on a fresh machine"


def setup_commands(readme: str) -> list[str]:
    """The one-line commands of the set-up section's ```bash blocks."""
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start:end if end >= 0 else len(readme)]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    for block in blocks:
        if "\n" in block.strip():
            raise ValueError(f"a set-up command must be one line to paste, got:\n{block}")
    return [block.strip() for block in blocks]


def main(argv: list[str]) -> int:
    commands = setup_commands(README.read_text(encoding="utf-8"))
    if argv[:1] != ["--check"]:
        print("\n".join(commands))
        return 0
    first, *others = argv[1:]
    if commands[:1] != [first] or any(other not in commands for other in others):
        print(f"{README.name} and .ci/run disagree on the set-up commands:", file=sys.stderr)
        for name, lines in (("README", commands), (".ci/run", argv[1:])):
            print(f"  {name}:", *lines, sep="\n    ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
