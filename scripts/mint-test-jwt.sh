#!/usr/bin/env bash
# Prints a JWT for the JWT and LLM examples (`make run EXAMPLE=jwt`, `make run EXAMPLE=llm`),
# signed RS256 with the TEST key whose public half is envoy/jwt/jwks.json (kid test-key-1), valid
# for an hour. For trying the examples only: anyone can mint these.
#   scripts/mint-test-jwt.sh [--sub alice] [--tenant acme]
set -euo pipefail
cd "$(dirname "$0")/.."
sub=alice tenant=acme
while [ $# -gt 0 ]; do
  case "$1" in
    --sub) sub=$2; shift 2 ;;
    --tenant) tenant=$2; shift 2 ;;
    *) echo "usage: $0 [--sub USER] [--tenant TENANT]" >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "mint-test-jwt: needs openssl (apt-get install openssl)" >&2; exit 1; }
json_string() { python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }
b64url() { openssl base64 -A | tr '+/' '-_' | tr -d '='; }
header=$(printf '{"alg":"RS256","typ":"JWT","kid":"test-key-1"}' | b64url)
payload=$(printf '{"iss":"https://issuer.example.com","sub":%s,"tenant":%s,"exp":%d}' \
  "$(json_string "$sub")" "$(json_string "$tenant")" "$(($(date +%s) + 3600))" | b64url)
signature=$(printf '%s.%s' "$header" "$payload" |
  openssl dgst -sha256 -sign tests/fixtures/jwt-test-key.pem -binary | b64url)
printf '%s.%s.%s\n' "$header" "$payload" "$signature"
