#!/usr/bin/env python3
"""dbufd's folders use one another one way only (docs/daemon.md, "Layers").

The build already refuses most slips: a folder's private headers are on the
include path of its library and of those above it only. What it cannot see,
this checks:
  - the public headers (dbuf/daemon/*.hpp) are on every folder's path; each
    belongs to one folder, and only that folder and those above it include it
    (the public headers themselves included);
  - a header reached by a relative path ("../control/jobs.hpp") compiles
    anywhere: refused;
  - a private header named in two folders would let an include pick either;
  - the libraries of daemon/CMakeLists.txt link only the folders USES allows;
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

INCLUDE = re.compile(r'^\s*#\s*include\s+["<]([^">]+)[">]', re.MULTILINE)
LINKS = re.compile(r"target_link_libraries\(\s*dbuf_daemon(?:_(\w+))?\b([^)]*)\)")


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

    sources = [(folder, path) for folder in USES for path in sorted((src / folder).glob("*.[ch]pp"))]
    public_dir = root / "daemon" / "include" / "dbuf" / "daemon"
    sources += [(PUBLIC_HEADERS[path.name], path) for path in sorted(public_dir.glob("*.hpp"))
                if path.name in PUBLIC_HEADERS]
    for folder, path in sources:
        uses = USES[folder]
        name = f"{path.parent.name}/{path.name}"
        for included in INCLUDE.findall(path.read_text()):
            if included.startswith(".") or "/../" in included:
                slips.append(f"{name} includes \"{included}\" by a relative path: name the header alone")
                continue
            if included.startswith("dbuf/daemon/"):
                home = PUBLIC_HEADERS.get(included.removeprefix("dbuf/daemon/"))
            elif "/" in included or included not in owner:
                continue  # another library of the project (common, ipc...) or a system header
            else:
                home = owner[included]
            if home is None:
                slips.append(f"{name} includes \"{included}\", which no folder holds")
            elif home != folder and home not in uses:
                slips.append(f"{name} includes \"{included}\" of {home}/, "
                             f"which {folder}/ may not use (it uses {sorted(uses) or 'nothing'})")

    cmake = (root / "daemon" / "CMakeLists.txt").read_text()
    linked = 0
    for suffix, libraries in LINKS.findall(cmake):
        folder = suffix or "service"  # dbuf_daemon is service's library
        for other in re.findall(r"\bdbuf_daemon(?:_(\w+))?\b", libraries):
            other = other or "service"
            linked += 1
            if folder not in USES or (other != folder and other not in USES[folder]):
                slips.append(f"daemon/CMakeLists.txt links dbuf_daemon_{folder} to dbuf_daemon_{other}, "
                             f"against the order")
    if linked == 0:
        slips.append("daemon/CMakeLists.txt: no link between the folders' libraries found (the check is blind)")

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
