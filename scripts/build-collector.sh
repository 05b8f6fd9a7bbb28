#!/usr/bin/env bash
# Build otelcol-rl, the project's OpenTelemetry Collector, into .cache/bin/otelcol-rl.
#
#   bash scripts/build-collector.sh               # build when the sources changed since the last build
#   bash scripts/build-collector.sh --force       # build again
#   bash scripts/build-collector.sh --regenerate  # after editing deploy/collector/build/manifest.yaml: run the
#                                                 # official builder (OCB) to rewrite the Go sources, then build
#
# Sources: deploy/collector/build/ (manifest.yaml for OCB, and the main.go, components.go, go.mod and go.sum it
# generated, committed). Needs Go >= 1.26 and the Go module proxy. Everything Go downloads or compiles stays
# under .cache/ (GOMODCACHE, GOCACHE), so a rebuild after a manifest change is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=deploy/collector/build
OUT=.cache/bin/otelcol-rl
export GOMODCACHE="$ROOT/.cache/gomod" GOCACHE="$ROOT/.cache/gobuild" GOFLAGS="-modcacherw" GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0
command -v go >/dev/null 2>&1 || { echo "build-collector: 'go' not found (Go >= 1.26 is needed: https://go.dev/dl/)" >&2; exit 1; }
mkdir -p .cache/bin

if [ "${1:-}" = "--regenerate" ]; then
  OCB_VERSION=$(sed -n 's#.*go.opentelemetry.io/collector/receiver/otlpreceiver \(v[0-9.]*\).*#\1#p' "$SRC/manifest.yaml")
  GOBIN="$ROOT/.cache/bin" go install "go.opentelemetry.io/collector/cmd/builder@$OCB_VERSION"
  .cache/bin/builder --config "$SRC/manifest.yaml" --skip-compilation
fi

stamp() { cat "$SRC"/manifest.yaml "$SRC"/go.mod "$SRC"/go.sum "$SRC"/*.go | sha256sum | cut -d' ' -f1; }
want="$(stamp) $(go env GOVERSION)"
if [ "${1:-}" != "--force" ] && [ -x "$OUT" ] && [ "$(cat "$OUT.stamp" 2>/dev/null)" = "$want" ]; then
  echo "otelcol-rl is up to date: $OUT"
  exit 0
fi
start=$(date +%s)
(cd "$SRC" && go build -mod=readonly -trimpath -ldflags="-s -w" -o "$ROOT/$OUT.tmp" .)
mv "$OUT.tmp" "$OUT"
echo "$want" > "$OUT.stamp"
echo "built $OUT in $(( $(date +%s) - start )) s ($("$OUT" --version))"
