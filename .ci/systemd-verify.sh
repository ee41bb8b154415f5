#!/usr/bin/env bash
# Checks deploy/systemd/devicehost.service with `systemd-analyze verify`, where that
# exists. verify refuses an ExecStart binary that is not there, so it checks a copy of
# the unit whose ExecStart points at a devicehost built here. It exits 0 on unknown keys
# and bad values (it only prints them), so any line naming the unit fails the check too.
set -euo pipefail
cd "$(dirname "$0")/.."

unit=deploy/systemd/devicehost.service
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "systemd-analyze not found: skipping the check of $unit"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# -race: the binary only has to exist; .ci/run has just compiled every dependency with
# -race (go vet -race), so this only links, where a plain build compiles them all again.
go build -race -o "$tmp/devicehost" ./cmd/devicehost
exec_start=$(grep -c '^ExecStart=/usr/local/bin/devicehost ' "$unit" || true)
if [ "$exec_start" != 1 ]; then
  echo "$unit: want exactly one ExecStart=/usr/local/bin/devicehost ... line, found $exec_start"; exit 1
fi
sed "s#^ExecStart=/usr/local/bin/devicehost #ExecStart=$tmp/devicehost #" "$unit" > "$tmp/devicehost.service"

systemd-analyze --version | head -1
rc=0
out=$(systemd-analyze verify "$tmp/devicehost.service" 2>&1) || rc=$?
[ -n "$out" ] && printf '%s\n' "$out"
if [ "$rc" != 0 ] || grep -q 'devicehost\.service' <<<"$out"; then
  echo "systemd-analyze verify: $unit has problems (exit $rc; lines above)"; exit 1
fi
echo "systemd-analyze verify: $unit OK"
systemd-analyze security --offline=true "$tmp/devicehost.service" 2>/dev/null | tail -1 || true
