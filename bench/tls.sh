# Sourced by bench/run inside each hit-path round: TLS on against off on the hit path (issue 13).
# fio's nbd engine cannot load certificates (libnbd refuses a URI naming local files unless the
# program allows it), so both rows go through the same client-side proxy, nbdkit's nbd plugin,
# which talks to ssdcache once in plaintext and once over TLS (x509, made here with openssl):
# the ratio of the two rows is what TLS costs; the proxy's own cost is in both.

tls_pki() { # the CA and server certificate, once per run
    [ -s "$T/pki/server-cert.pem" ] && return 0
    mkdir -p "$T/pki"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -keyout "$T/pki/ca-key.pem" -out "$T/pki/ca-cert.pem" -subj "/CN=bench CA" 2>/dev/null ||
        die "openssl could not make the benchmark's CA"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
        -keyout "$T/pki/server-key.pem" -out "$T/pki/server.csr" 2>/dev/null || die "openssl key"
    printf 'subjectAltName=DNS:localhost\n' >"$T/pki/server.ext"
    openssl x509 -req -in "$T/pki/server.csr" -CA "$T/pki/ca-cert.pem" -CAkey "$T/pki/ca-key.pem" \
        -CAcreateserial -days 2 -out "$T/pki/server-cert.pem" -extfile "$T/pki/server.ext" 2>/dev/null ||
        die "openssl could not sign the benchmark's server certificate"
    printf 'policy = "%s"\ntls = "on"\ntls_certificates = "%s"\n' "$DEFAULT_POLICY" "$T/pki" >"$T/tls.toml"
}

tls_round() { # round
    tls_pki
    start_ssdcache "" "$T/tls.toml"
    warm
    local proxy="$T/proxy.sock" tls key label proxy_pid
    for tls in off require; do
        key=ssdcache-proxy label="ssdcache through nbdkit's nbd plugin, plaintext"
        if [ "$tls" = require ]; then
            key=ssdcache-proxy-tls label="ssdcache through nbdkit's nbd plugin, TLS"
        fi
        rm -f "$proxy"
        local args=(--unix "$proxy" --foreground nbd "socket=$SOCK" "tls=$tls"
                    "tls-certificates=$T/pki")
        note_cmd_once nbdkit "${args[@]}"
        nbdkit "${args[@]}" >>"$T/nbdkit.log" 2>&1 &
        proxy_pid=$!
        STARTED_PIDS+=("$proxy_pid")
        wait_socket "$proxy_pid" "$proxy" || { tail -20 "$T/nbdkit.log" >&2; die "the nbd proxy did not start"; }
        measure "$key" "$label" "$1" "$SERVER_PID" "${COMMON[@]}" --ioengine=nbd \
            --uri="nbd+unix:///?socket=$proxy" --offset=0
        stop_pid "$proxy_pid"
        forget_pid "$proxy_pid"
    done
    stop_server
}
