#!/usr/bin/env bash
# The runtime dependency lock (requirements.lock) and what is checked against it.
#
#   scripts/lock.sh compile   regenerate requirements.lock from pyproject.toml: every runtime
#                             dependency, transitive ones included, pinned with the hashes of all
#                             files of that release (so the wheels for amd64 and arm64 are there)
#   scripts/lock.sh check     fail if requirements.lock no longer matches pyproject.toml
#   scripts/lock.sh audit     known vulnerabilities of the locked packages (PyPI's advisory data)
#   scripts/lock.sh sbom      a CycloneDX SBOM of the locked (= installed in the image) packages
#
# Needs the dev tools (uv, pip-audit, cyclonedx-py) of $VENV (default .venv) and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${VENV:-.venv}/bin
LOCK=requirements.lock
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
SBOM=${SBOM:-dist/vramguard-$VERSION.cdx.json}

# Existing pins in the output file are kept while they still satisfy pyproject.toml, so compiling
# an up-to-date lock changes nothing, and a new release upstream does not make it stale.
compile() {
    "$BIN/uv" pip compile pyproject.toml --quiet --native-tls --generate-hashes --universal \
        --python-version 3.11 --custom-compile-command "make lock" -o "$1"
}

case ${1:-} in
    compile)
        compile "$LOCK"
        echo "lock: $(grep -c '^[a-z0-9]' "$LOCK") packages in $LOCK" ;;
    check)
        fresh=$(mktemp)
        trap 'rm -f "$fresh"' EXIT
        cp "$LOCK" "$fresh"
        compile "$fresh"
        if ! diff -u "$LOCK" "$fresh"; then
            echo "lock: $LOCK does not match pyproject.toml: run make lock and commit it" >&2
            exit 1
        fi
        echo "lock: $LOCK matches pyproject.toml ($(grep -c '^[a-z0-9]' "$LOCK") packages)" ;;
    audit)
        # pip-audit asks PyPI's JSON API per release; where that API is not reachable every package
        # is reported "not found" and nothing is audited: say so, and fail only on a vulnerability
        # found (pip-audit exits 1 then).
        report=$(mktemp)
        trap 'rm -f "$report"' EXIT
        status=0
        "$BIN/pip-audit" -r "$LOCK" --require-hashes --disable-pip --progress-spinner off --desc on \
            > "$report" 2>&1 || status=$?
        cat "$report"
        total=$(grep -c '^[a-z0-9]' "$LOCK")
        skipped=$(grep -c 'could not be audited' "$report" || true)
        if [[ $skipped -gt 0 ]]; then
            echo "audit: $skipped of $total locked packages could not be audited (PyPI's advisory data not reachable for them)"
        fi
        if [[ $status -ne 0 ]]; then
            echo "audit: vulnerabilities found in $LOCK (see above): update the pins in pyproject.toml, make lock" >&2
            exit "$status"
        fi
        echo "audit: no known vulnerability in the $(( total - skipped )) audited packages" ;;
    sbom)
        mkdir -p "$(dirname "$SBOM")"
        "$BIN/cyclonedx-py" requirements --pyproject pyproject.toml --output-reproducible --of JSON \
            -o "$SBOM" "$LOCK"
        echo "sbom: $SBOM, $(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["components"]))' "$SBOM") components" ;;
    *)
        echo "usage: $0 compile|check|audit|sbom" >&2
        exit 2 ;;
esac
