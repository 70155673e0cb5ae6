#!/usr/bin/env bash
# The .deb, built with cpack from the build tree and installed for real with
# dpkg into a throwaway root: an overlay whose lower layer is / and whose
# upper layer is a tmpfs, in a private mount namespace, entered with chroot.
# The machine itself is not altered (checked at the end). Inside: dpkg -i,
# then dbufd --check of the conffile, dbufctl --help, ldconfig finds
# libdbuf.so.0, the user and /etc/dbufd exist, systemd-analyze verify passes
# on the installed unit, pkg-config and find_package see the /usr install, an
# edit of the conffile survives a reinstall, dpkg -r keeps it and dpkg -P
# removes it. Root only (exit 77 otherwise).
#   deb_test.sh BUILD_DIR WORKDIR VERSION MULTIARCH
# MULTIARCH: Debian's library directory name (x86_64-linux-gnu), where the
# .deb must put libdbuf, its CMake package and its pkg-config file.
set -euo pipefail
die() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIPPED: $*"; exit 77; }
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

if [[ "${1:-}" == --in-chroot ]]; then
  # ---- inside the throwaway root (chroot) -----------------------------------
  deb=$2
  version=$3
  export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  export DEBIAN_FRONTEND=noninteractive LC_ALL=C
  step() { echo "-- chroot: $*"; }
  ! dpkg-query -W dbuf >/dev/null 2>&1 || die "dbuf is already installed in the lower root"
  step "dpkg -i $(basename "$deb")"
  dpkg -i "$deb"
  [[ "$(dpkg-query -W -f='${Status} ${Version}' dbuf)" == "install ok installed $version" ]] ||
    die "dpkg says: $(dpkg-query -W -f='${Status} ${Version}' dbuf)"
  step "dbufd --config /etc/dbufd/dbufd.toml --check"
  dbufd --config /etc/dbufd/dbufd.toml --check
  step "dbufctl --help"
  dbufctl --help >/dev/null
  dbuf-plan --help >/dev/null
  step "ldconfig -p | grep libdbuf"
  ldconfig -p | grep -F 'libdbuf.so.0 ' || die "ldconfig does not know libdbuf.so.0"
  step "the user dbufd, /etc/dbufd and the conffile"
  getent passwd dbufd || die "postinst did not create the user dbufd"
  [[ -d /etc/dbufd && -f /etc/dbufd/dbufd.toml ]] || die "no /etc/dbufd/dbufd.toml"
  dpkg-query -W -f='${Conffiles}\n' dbuf | grep -F /etc/dbufd/dbufd.toml || die "/etc/dbufd/dbufd.toml is no conffile"
  step "systemd-analyze verify /lib/systemd/system/dbufd.service"
  # No systemd runs here: verify loads the unit as a system manager in test
  # mode would, offline. --man=no: man pages are not installed in CI images.
  out=$(systemd-analyze verify --man=no /lib/systemd/system/dbufd.service 2>&1) ||
    { echo "$out" >&2; die "verify failed"; }
  [[ -z "$out" ]] || { echo "$out" >&2; die "systemd-analyze verify complained"; }
  step "pkg-config and find_package see the /usr install"
  [[ "$(pkg-config --modversion dbuf)" == "$version" ]] || die "pkg-config: $(pkg-config --modversion dbuf 2>&1)"
  [[ "$(pkg-config --cflags --libs dbuf)" == *-ldbuf* ]] || die "pkg-config --libs dbuf: $(pkg-config --libs dbuf)"
  cmake --find-package -DNAME=dbuf -DCOMPILER_ID=GNU -DLANGUAGE=C -DMODE=EXIST | grep -q 'dbuf found' ||
    die "cmake does not find the package dbuf under /usr"
  step "an edited conffile survives a reinstall; dpkg -r keeps it, dpkg -P removes it"
  echo '# edited by the operator' >>/etc/dbufd/dbufd.toml
  dpkg -i --force-confold "$deb" >/dev/null
  [[ "$(tail -n 1 /etc/dbufd/dbufd.toml)" == '# edited by the operator' ]] ||
    die "the reinstall replaced the edited conffile"
  dpkg -r dbuf
  [[ ! -e /usr/bin/dbufd ]] && ! compgen -G '/usr/lib/*/libdbuf.so*' >/dev/null && [[ ! -e /usr/lib/libdbuf.so.0 ]] ||
    die "dpkg -r left the binaries"
  [[ -f /etc/dbufd/dbufd.toml ]] || die "dpkg -r removed the conffile"
  dpkg -P dbuf
  [[ ! -e /etc/dbufd ]] || die "dpkg -P left /etc/dbufd"
  echo "-- chroot: ok"
  exit 0
fi

if [[ "${1:-}" == --in-namespace ]]; then
  # ---- in the private mount namespace: build the throwaway root ----------------
  deb=$2
  version=$3
  layers=$4
  mount -t tmpfs -o mode=0755 dbuf-deb-test "$layers" || die "mounting a tmpfs"
  mkdir -p "$layers/upper" "$layers/work" "$layers/root"
  mount -t overlay overlay -o "lowerdir=/,upperdir=$layers/upper,workdir=$layers/work" "$layers/root" ||
    skip "cannot mount an overlay of / here"
  root=$layers/root
  mount --rbind /dev "$root/dev"
  mount --bind /proc "$root/proc"
  mount --rbind /sys "$root/sys"
  # A /run and /tmp of its own: no running systemd in there (postinst must
  # see none), nothing of the machine's sockets.
  mount -t tmpfs -o mode=0755 run "$root/run"
  mount -t tmpfs -o mode=1777 tmp "$root/tmp"
  cp "$deb" "$root/tmp/"
  cp "$0" "$root/tmp/deb_test.sh"
  chroot "$root" /bin/bash /tmp/deb_test.sh --in-chroot "/tmp/$(basename "$deb")" "$version"
  exit $?
fi

# ---- outside: build the .deb, then install it into the throwaway root ----------
build=$1
work=$2
version=$3
multiarch=${4:-}
[[ $(id -u) -eq 0 ]] || skip "needs root (a mount namespace, an overlay, chroot, dpkg); CI runs as root"
for tool in cpack dpkg dpkg-deb dpkg-shlibdeps unshare chroot; do
  command -v "$tool" >/dev/null || die "$tool is missing (scripts/install-deps.sh)"
done
rm -rf "$work"
mkdir -p "$work/layers"

# cpack runs the build tree's preinstall target first (an up-to-date check
# when the tree is built, as it is before ctest).
start=$(date +%s%N)
(cd "$build" && cpack -G DEB -B "$work/cpack") >"$work/cpack.log" 2>&1 ||
  { cat "$work/cpack.log" >&2; die "cpack -G DEB"; }
arch=$(dpkg --print-architecture)
deb="$work/cpack/dbuf_${version}_${arch}.deb"
[[ -f "$deb" ]] || { ls "$work/cpack" >&2; die "no $deb"; }
echo "cpack -G DEB: $(basename "$deb"), $(stat -c %s "$deb") bytes, in $(ms "$start") ms"

field() { dpkg-deb -f "$deb" "$1"; }
[[ "$(field Package)" == dbuf && "$(field Version)" == "$version" && "$(field Architecture)" == "$arch" ]] ||
  die "control: $(dpkg-deb -f "$deb" Package Version Architecture)"
depends=$(field Depends)
[[ "$depends" == *libc6* && "$depends" == *libstdc++6* ]] || die "Depends is not computed: '$depends'"
echo "Depends: $depends"
control=$(dpkg-deb --ctrl-tarfile "$deb" | tar -t)
for file in postinst prerm postrm conffiles triggers shlibs; do
  grep -qx "\./$file" <<<"$control" || die "the .deb has no $file"
done
conffiles=$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles)
[[ "$conffiles" == /etc/dbufd/dbufd.toml ]] || die "conffiles: '$conffiles', not /etc/dbufd/dbufd.toml"
contents=$(dpkg-deb -c "$deb")
grep -q ' \./etc/dbufd/dbufd\.toml$' <<<"$contents" || die "the .deb does not hold /etc/dbufd/dbufd.toml"
[[ -n "$multiarch" ]] || die "no multiarch directory given (CMake found no CMAKE_LIBRARY_ARCHITECTURE on this Debian)"
for file in libdbuf.so.0 cmake/dbuf/dbufConfig.cmake pkgconfig/dbuf.pc; do
  grep -qF " ./usr/lib/$multiarch/$file" <<<"$contents" ||
    die "the .deb has no /usr/lib/$multiarch/$file (Debian's multiarch directory): $(grep -F libdbuf <<<"$contents")"
done

# The machine before, to compare after.
exists() { if [[ -e "$1" ]]; then echo present; else echo absent; fi; }
before_etc=$(exists /etc/dbufd)
before_pkg=$(dpkg-query -W -f='${Status}' dbuf 2>/dev/null || echo absent)

unshare --mount --propagation private true 2>/dev/null || skip "unshare --mount is not permitted here"
start=$(date +%s%N)
unshare --mount --propagation private bash "$0" --in-namespace "$deb" "$version" "$work/layers" 2>&1 |
  tee "$work/chroot.log"
status=${PIPESTATUS[0]}
((status != 77)) || exit 77
((status == 0)) || die "installing the .deb in the throwaway root failed (exit $status; log $work/chroot.log)"
echo "install, checks, remove and purge in the throwaway root: $(ms "$start") ms"

# Nothing of it reached the machine.
[[ "$(exists /etc/dbufd)" == "$before_etc" ]] || die "/etc/dbufd changed on the machine"
[[ "$(dpkg-query -W -f='${Status}' dbuf 2>/dev/null || echo absent)" == "$before_pkg" ]] ||
  die "the machine's dpkg database changed"
! mountpoint -q "$work/layers" || die "the throwaway root is still mounted"
echo "ok: $(basename "$deb")"
