#!/bin/sh
# A self-signed certificate for trying the compose deployment on one machine:
#   ./make-dev-cert.sh [server-name]      (default: localhost)
# writes certs/fullchain.pem and certs/privkey.pem, which nginx reads. Clients must then trust
# certs/fullchain.pem (curl --cacert, OpenAI(http_client=httpx.Client(verify=...))).
# For production use a real certificate: docs/deployment.md, "TLS certificates".
set -eu
name="${1:-localhost}"
san="DNS:localhost,IP:127.0.0.1"
[ "$name" = localhost ] || san="DNS:${name},${san}"
cd "$(dirname "$0")"
mkdir -p certs
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
  -subj "/CN=${name}" \
  -addext "subjectAltName=${san}" \
  -keyout certs/privkey.pem -out certs/fullchain.pem
# nginx-unprivileged reads them as uid 101, so both are world-readable: fine for a throwaway
# development key, never for a real one (give that one to uid 101 with mode 0400).
chmod 644 certs/fullchain.pem certs/privkey.pem
echo "wrote $(pwd)/certs/fullchain.pem and privkey.pem for ${name} (valid 30 days)"
