#!/usr/bin/env python3
"""dbufd's folders use one another one way only (docs/daemon.md, "Layers").

The build already refuses most slips: a folder's private headers are on the
include path of its library and of those above it only. What it cannot see,
this checks:
  - the public headers (dbuf/daemon/*.hpp) are on every folder's path; each
    belongs to one folder, and only that folder and those above it include it;
  - a private header named in two folders would let an include pick either;
  - the folders on disk are the ones below, and docs/daemon.md maps each.
Run: python3 layering_test.py <repository root>. Prints each slip; exits 1 if any.
"""

import re
import sys
from pathlib import Path

# Each folder and the folders it may include from (directly or not).
USES = {
    "base": set(),
    "memory": {"base"},
    "cluster": {"base"},
    "execution": {"base", "memory", "cluster"},
    "scheduling": {"base", "memory", "cluster", "execution"},
    "control": {"base", "memory", "cluster", "execution", "scheduling"},
    "service": {"base", "memory", "cluster", "execution", "scheduling", "control"},
}

# daemon/include/dbuf/daemon/<header>: the folder whose library implements it.
PUBLIC_HEADERS = {
    "config.hpp": "base",
    "lock_file.hpp": "base",
    "logging.hpp": "base",
    "server.hpp": "service",
    "systemd_notify.hpp": "service",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def main(root: Path) -> int:
    src = root / "daemon" / "src"
    slips: list[str] = []
    folders = sorted(p.name for p in src.iterdir() if p.is_dir())
    if folders != sorted(USES):
        slips.append(f"daemon/src has folders {folders}; this test and docs/daemon.md know {sorted(USES)}")
    loose = sorted(p.name for p in src.iterdir() if p.is_file())
    if loose:
        slips.append(f"files outside the folders of daemon/src: {loose}")
    public = sorted(p.name for p in (root / "daemon" / "include" / "dbuf" / "daemon").glob("*.hpp"))
    if public != sorted(PUBLIC_HEADERS):
        slips.append(f"public headers {public}; this test knows {sorted(PUBLIC_HEADERS)}")

    owner: dict[str, str] = {}
    for folder in USES:
        for header in (src / folder).glob("*.hpp"):
            if header.name in owner:
                slips.append(f"{header.name} is in both {owner[header.name]}/ and {folder}/")
            owner[header.name] = folder

    for folder, uses in USES.items():
        for path in sorted((src / folder).glob("*.[ch]pp")):
            for included in INCLUDE.findall(path.read_text()):
                if included.startswith("dbuf/daemon/"):
                    home = PUBLIC_HEADERS.get(included.removeprefix("dbuf/daemon/"))
                elif "/" in included:
                    continue  # another library of the project (common, ipc, planner...)
                else:
                    home = owner.get(included)
                if home is None:
                    slips.append(f"{folder}/{path.name} includes \"{included}\", which no folder holds")
                elif home != folder and home not in uses:
                    slips.append(f"{folder}/{path.name} includes \"{included}\" of {home}/, "
                                 f"which {folder}/ may not use (it uses {sorted(uses) or 'nothing'})")

    doc = (root / "docs" / "daemon.md").read_text()
    for folder in USES:
        if f"`daemon/src/{folder}/`" not in doc:
            slips.append(f"docs/daemon.md's map does not name `daemon/src/{folder}/`")

    for slip in slips:
        print("layering:", slip)
    print(f"layering: {len(slips)} slip(s) in {len(USES)} folders")
    return 1 if slips else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
