#!/usr/bin/env bash
# libdbuf.so exports its public API and nothing else:
#   check_symbols.sh LIBRARY ALLOW_LIST [fail|skip]
# Every defined dynamic symbol (nm -D --defined-only, demangled) must start
# with a prefix of ALLOW_LIST (exported_symbols.txt), with a version DBUF_0 or later (DBUF_0.2);
# the SONAME must be libdbuf.so.0; and a few symbols of each part of the API
# must be there (an empty export list would pass the rest).
set -euo pipefail
# The last argument says what a library that is not built is: a failure, or
# (a sanitizer build's subset) a skip.
library=$1
allow_list=$2
if_missing=${3:-fail}
die() { echo "FAIL: $*" >&2; exit 1; }

if [[ ! -f "$library" ]]; then
  [[ "$if_missing" != skip ]] || { echo "SKIPPED: $library is not built"; exit 77; }
  die "no library at $library"
fi
soname=$(readelf -d "$library" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ "$soname" == libdbuf.so.0 ]] || die "SONAME is '$soname', not libdbuf.so.0"

mapfile -t prefixes < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$allow_list" | grep -v '^$')
((${#prefixes[@]} > 0)) || die "no prefixes in $allow_list"

# "ADDRESS TYPE NAME": the name may hold spaces (demangled signatures).
symbols=$(nm -D --defined-only -C "$library" | sed -E 's/^[0-9a-f]* *[A-Za-z] //')
count=0
bad=()
unversioned=()
while IFS= read -r symbol; do
  [[ -n "$symbol" ]] || continue
  count=$((count + 1))
  name=${symbol%@@DBUF_0*}
  [[ "$name" != "$symbol" || "$symbol" == DBUF_0* ]] || unversioned+=("$symbol")
  ok=0
  for prefix in "${prefixes[@]}"; do
    if [[ "$name" == "$prefix"* ]]; then ok=1; break; fi
  done
  ((ok)) || bad+=("$symbol")
done <<<"$symbols"

for required in 'dbuf_connect' 'dbuf_group_view' 'dbuf_run' 'dbuf::Client::connect(' 'dbuf::Group::unshard(' \
                'dbuf_group_unregister@@DBUF_0.2' 'dbuf::Group::registered() const@@DBUF_0.2' \
                'dbuf::planner::planUnit(' 'dbuf::planner::GranularityRule::parse(' 'dbuf::planner::planMerges('; do
  grep -qF -- "$required" <<<"$symbols" || die "$required is not exported"
done

if ((${#bad[@]} > 0)); then
  echo "FAIL: ${#bad[@]} of $count exported symbols are outside the public prefixes ($allow_list):" >&2
  printf '  %s\n' "${bad[@]}" | head -n 40 >&2
  exit 1
fi
if ((${#unversioned[@]} > 0)); then
  echo "FAIL: exported without a version DBUF_0*:" >&2
  printf '  %s\n' "${unversioned[@]}" | head -n 40 >&2
  exit 1
fi
summary=""
for prefix in "${prefixes[@]}"; do
  n=$(awk -v p="$prefix" 'index($0, p) == 1' <<<"$symbols" | wc -l)
  summary+=" $prefix: $n;"
done
echo "ok: $library (SONAME $soname): $count exported symbols, all public:$summary"
