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
  # One file per certificate: the hashed links that OpenSSL's CApath lookups use are made for
  # single-certificate files only (the bundle that pip reads takes them all).
  awk -v dir=/usr/local/share/ca-certificates '
    /-----BEGIN CERTIFICATE-----/ { n++; out = sprintf("%s/hvd_slowmo_build_extra_%d.crt", dir, n) }
    out != "" { print > out }
    /-----END CERTIFICATE-----/ { close(out); out = "" }' <<<"$EXTRA_CA_CERTS"
  update-ca-certificates >/dev/null
  count=$(find /usr/local/share/ca-certificates -name 'hvd_slowmo_build_extra_*.crt' | wc -l)
  echo "trust_build_ca: $count extra CA certificate(s) trusted in this stage"
fi
# pip trusts its own copy of Mozilla's list (certifi), not the system's: point it at the system
# bundle, which holds the same list plus the extra certificates.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf
