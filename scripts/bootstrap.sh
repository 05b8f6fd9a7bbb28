#!/usr/bin/env bash
# Create .venv and install otel-rl with everything it needs. Idempotent.
#   bash scripts/bootstrap.sh          # the package + tracker exporters + what the example needs
#   bash scripts/bootstrap.sh --test   # + test dependencies, the Prometheus binary, the Collector (needs Go >= 1.26)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q -c scripts/constraints.txt)
.venv/bin/python -m pip install -q --upgrade pip
# torch pinned: the CPU wheel on this machine; an unpinned torch pulls a multi-GB CUDA build
"${PIP[@]}" "torch==2.13.0"
# the tracker exporter distributions that live in this repository
EXPORTERS=()
for d in exporters/*/; do
  [ -f "$d/pyproject.toml" ] && EXPORTERS+=(-e "$d")
done
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test,all,docs,lint]" "${EXPORTERS[@]}"
  # the real verl package for the compatibility tests: without its GPU stack (--no-deps), plus
  # the light packages `import verl` needs; and Ray for the distributed tests
  "${PIP[@]}" --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers<0.2"
  # transformers with TRL (the pair otel_rl.integrations.transformers is tested with; the `trl` extra)
  "${PIP[@]}" "transformers>=5.5.3,<5.11,!=5.6.0" "trl==1.16.0" "ray==2.60.0" msgpack
  # headless Chromium for the browser tests of web UIs and the report page (tests/ui, tests/tools)
  if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
      || echo "warning: could not install chromium" >&2
  fi
  if ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null \
        || echo "warning: could not install prometheus" >&2
    fi
  fi
  # otelcol-rl, the project's OpenTelemetry Collector (Go, from the official modules; built once, then only
  # when deploy/collector/build/ changes) -> .cache/bin/otelcol-rl
  bash scripts/build-collector.sh
  # Arize Phoenix, the OpenInference trace store behind the gateway (deploy/collector/phoenix.yaml): its pins
  # clash with ours, so it gets its own venv, made again only when scripts/phoenix-requirements.txt changes
  PHX=.cache/phoenix-venv
  PHX_WANT=$(sha256sum scripts/phoenix-requirements.txt | cut -d' ' -f1)
  if [ "$(cat "$PHX/.requirements-sha256" 2>/dev/null)" != "$PHX_WANT" ]; then
    rm -rf "$PHX"
    "$PY" -m venv "$PHX"
    "$PHX/bin/python" -m pip install -q --upgrade pip
    "$PHX/bin/python" -m pip install -q -r scripts/phoenix-requirements.txt
    echo "$PHX_WANT" > "$PHX/.requirements-sha256"
  fi
  # older MLflow tracking servers (2.x: no trace API of an MLflow 3 client; 3.0-3.3: no span ingestion) for the
  # doctor's server-version test: mlflow-skinny and the server's own needs, one venv each (~165 MB, ~20-30 s), made
  # again only when scripts/mlflow-<version>-requirements.txt changes
  for req in scripts/mlflow-*-requirements.txt; do
    OLD=.cache/$(basename "$req" -requirements.txt)-venv
    OLD_WANT=$(sha256sum "$req" | cut -d' ' -f1)
    if [ "$(cat "$OLD/.requirements-sha256" 2>/dev/null)" != "$OLD_WANT" ]; then
      rm -rf "$OLD"
      "$PY" -m venv "$OLD"
      "$OLD/bin/python" -m pip install -q --upgrade pip
      "$OLD/bin/python" -m pip install -q -r "$req"
      echo "$OLD_WANT" > "$OLD/.requirements-sha256"
    fi
  done
else
  "${PIP[@]}" -e ".[all]" "${EXPORTERS[@]}"
fi
# The repository's own packages are installed editable, which leaves them uncompiled: compile them now, as
# pip does for a regular install.  Where Python writes no bytecode at run time (PYTHONDONTWRITEBYTECODE),
# every start would otherwise compile them again (~50 ms of `init()` with the tracker exporters).
.venv/bin/python -m compileall -q otel_rl exporters >/dev/null
