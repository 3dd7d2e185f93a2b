#!/usr/bin/env bash
# A development CA and the certificates the compose file mounts (not for production: use your
# own CA, or cert-manager on Kubernetes, and keep its key off the serving hosts).
#   deploy/make-dev-certs.sh [DIR] [EXTRA_NAME...]     (DIR default: deploy/certs)
# Writes into DIR, one folder per process in the layout of a Kubernetes TLS Secret (and of
# cert-manager's), which is what the compose file mounts at /certs:
#   ca.crt                   the CA; clients of the public port trust it
#   frontend/tls.crt tls.key the public port's certificate, also the frontend's client certificate
#            ca.crt          towards the workers (serverAuth + clientAuth); the CA of the workers
#   worker/tls.crt tls.key   the workers' certificate (serverAuth; clientAuth too, so that the
#          ca.crt            worker's own health check can present it); the CA of its clients
# Names: localhost, 127.0.0.1, the compose names (frontend, worker) and the Kubernetes Services
# (openjev-frontend, openjev-worker, their .default.svc forms and the worker pods), plus each
# EXTRA_NAME (a DNS name or an IP address) on both certificates. The CA key is deleted after
# signing: run the script again for a new set. Keys are made readable by the images' user (uid
# 10001): chowned to it when run as root, else mode 0644 (a development directory).
set -euo pipefail
DIR=${1:-"$(dirname "$0")/certs"}
shift || true
DAYS=${OPENJEV_CERT_DAYS:-30}
mkdir -p "$DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

quiet() {  # openssl's progress output hidden, its errors shown (a failed step said nothing)
  local out
  if ! out=$("$@" 2>&1); then
    echo "$out" >&2
    return 1
  fi
}

names() {  # the subjectAltName list: the fixed names, then each extra argument
  local list="DNS:localhost,IP:127.0.0.1,$1"
  for extra in "${@:2}"; do
    if [[ $extra =~ ^[0-9.]+$ || $extra == *:* ]]; then list+=",IP:$extra"; else list+=",DNS:$extra"; fi
  done
  echo "$list"
}

leaf() {  # leaf NAME SAN: NAME/tls.key, NAME/tls.crt, NAME/ca.crt
  mkdir -p "$DIR/$1"
  chmod 0755 "$DIR/$1"  # under umask 077 the images' user could not enter it
  quiet openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=openjev-$1" \
    -keyout "$DIR/$1/tls.key" -out "$WORK/$1.csr"
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n%s\nsubjectAltName=%s\n' \
    "extendedKeyUsage=serverAuth,clientAuth" "$2" >"$WORK/$1.ext"
  quiet openssl x509 -req -in "$WORK/$1.csr" -CA "$DIR/ca.crt" -CAkey "$WORK/ca.key" -CAserial "$WORK/ca.srl" \
    -CAcreateserial -days "$DAYS" -sha256 -extfile "$WORK/$1.ext" -out "$DIR/$1/tls.crt"
  cp "$DIR/ca.crt" "$DIR/$1/ca.crt"
  chmod 0644 "$DIR/$1/tls.crt" "$DIR/$1/ca.crt"
  if [[ $(id -u) == 0 ]]; then
    chown 10001:10001 "$DIR/$1/tls.key" && chmod 0600 "$DIR/$1/tls.key"
  else
    chmod 0644 "$DIR/$1/tls.key"
  fi
}

quiet openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$DAYS" -sha256 \
  -subj "/CN=openjev development CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" -keyout "$WORK/ca.key" -out "$DIR/ca.crt"
FRONTEND="DNS:frontend,DNS:openjev-frontend,DNS:openjev-frontend.default.svc"
WORKER="DNS:worker,DNS:openjev-worker,DNS:openjev-worker.default.svc,DNS:*.openjev-worker"
leaf frontend "$(names "$FRONTEND" "$@")"
leaf worker "$(names "$WORKER" "$@")"
chmod 0644 "$DIR/ca.crt"
openssl verify -CAfile "$DIR/ca.crt" "$DIR/frontend/tls.crt" "$DIR/worker/tls.crt" >/dev/null
echo "certificates valid for $DAYS days in $DIR: ca.crt, frontend/{tls.crt,tls.key,ca.crt}, worker/{...}"
