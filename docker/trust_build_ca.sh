#!/usr/bin/env bash
# Build stages only: trust extra CA certificates for this stage's downloads (pip from PyPI), for
# builds behind a TLS-intercepting proxy. The final stages never run this script and copy nothing
# but the virtual environment from a build stage, so no extra CA reaches a published image.
#
# Usage: docker/trust_build_ca.sh
# Environment (the Dockerfiles pass their build ARG):
#   EXTRA_CA_CERTS   PEM text of one or more CA certificates, e.g.
#                    --build-arg EXTRA_CA_CERTS="$(cat /usr/local/share/ca-certificates/*.crt)";
#                    empty: nothing is added
set -euo pipefail

die() { echo "trust_build_ca: error: $*" >&2; exit 1; }

if [ -n "${EXTRA_CA_CERTS:-}" ]; then
  grep -q -- '-----BEGIN CERTIFICATE-----' <<<"$EXTRA_CA_CERTS" \
    || die "EXTRA_CA_CERTS must hold PEM certificates (-----BEGIN CERTIFICATE----- ...), e.g." \
      "--build-arg EXTRA_CA_CERTS=\"\$(cat proxy-ca.crt)\""
  printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/hvd_slowmo_build_extra.crt
  update-ca-certificates >/dev/null
  echo "trust_build_ca: $(grep -c -- '-----BEGIN CERTIFICATE-----' <<<"$EXTRA_CA_CERTS") extra CA certificate(s) trusted in this stage"
fi
# pip trusts its own copy of Mozilla's list (certifi), not the system's: point it at the system
# bundle, which holds the same list plus the extra certificates.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf
