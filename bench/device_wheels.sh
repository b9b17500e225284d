#!/bin/bash
# The test clients' wheels the device lacks (Python 3.12, x86-64), downloaded here into .gpu/c, which device.sh
# installs into /tmp/site on a fresh machine (carry [".gpu/c"]). The stage's own wheels are ../shared/gpu's.
# Left out: openai (the stage carries 1.109; the Codex tests' `namespace` tools need the 3.x the suite pins here).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/c
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .gpu/c \
  llguidance==1.6.1 anthropic==2.14.0 docstring_parser==0.18.0 xxhash==4.1.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  opentelemetry-api==1.45.2
ls .gpu/c
