# Shell pieces the bench scripts share: `source bench/lib.sh` from the repository root.

# Waits for a server's /health to answer: $1 is a port on 127.0.0.1 or a base URL; $2 the most
# seconds to wait (default 180: a cold model load on a busy 2-core machine).
wait_http() {
  local url=$1 tries=$(( ${2:-180} * 5 ))
  case $url in *[!0-9]*) ;; *) url=http://127.0.0.1:$1 ;; esac
  for _ in $(seq 1 "$tries"); do
    curl -sf "$url/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "nothing answered at $url" >&2; return 1
}
