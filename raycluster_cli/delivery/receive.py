"""The receiving host's side of a relay copy (an image archive or a model), as one bash script: fetch, verify
whole, publish, then use.

What a host receives is used only once all of it is there and its SHA-256 is the operator's (computed on the
operator's machine and handed over SSH): the bytes land in `<name>.part` in the host's staging folder, are
hashed whole (`sha256sum`, else python3's hashlib, else `openssl dgst`; a host with none of them is refused by
name, never skipped), and only a match is renamed to `<name>`, which is what the host's listener serves to
others and what the job's use step (`docker load`, a model's unpack into its cache) reads. A mismatch prints
CORRUPT and exits 65 without touching what the host had: the operator then fetches again from itself (a peer's
copy) or stops naming the host (its own).

The staging folder is a fixed name under /var/tmp, so it is checked before use, not trusted: it must be a
folder (not a link), owned by the login user, mode 0700 — made with `mkdir -m 700` (never `mkdir -p`, which
accepts a folder another user made first). Anything else is refused with one line naming the folder and its
owner (STAGING_REFUSED). The copy's pid file is read back only as digits naming a live `timeout` process
before anything is sent a signal. An EXIT trap removes the partial file however the script ends: the SSH
guard's SIGTERM after Ctrl-C (transport/guard.py), a stall stopped by the operator, a failed check.

A copy from a peer proves both ends: the receiver presents the copy's `ask` secret, the listener answers with
its `answer` secret before any byte of content, and a receiver that does not hear the answer takes nothing
(both secrets reach each host on stdin, over its SSH connection; a third host that took the listener's port
could answer neither). The content's SHA-256 then covers whatever a host in between could alter.
"""

from __future__ import annotations

from raycluster_cli.transport import quote

CONNECT_S = 20.0  # how long a receiver tries to reach the sender's listener before giving up
DEADLINE_S = 1800.0  # the whole copy
ANSWER_S = 10.0  # how long a receiver waits for the listener's answer once connected

# What a receive command prints (a line of its own) the moment its content is whole, its SHA-256 matched and it
# was published under its serving name: the operator hears it as it happens.
PUBLISHED = "raycluster: archive whole, SHA-256 matched, published"
CORRUPT = "raycluster-corrupt:"  # first words of the line (stderr) when what arrived does not match
CORRUPT_RC = 65
NO_HASH = "raycluster-nohash:"  # no tool on the host to verify what arrives
STAGING_REFUSED = "raycluster-refused:"  # the staging folder is not this login user's private folder
SENDER_UNPROVEN = "raycluster-sender:"  # the listener did not answer with the copy's answer secret

# SHA-256 of a file, hex, on stdout: the first tool the host has. (python3's hashlib reads in 1 MiB chunks.)
_PY_SHA = (
    "import hashlib,sys\nh=hashlib.sha256()\nf=open(sys.argv[1],'rb')\n"
    "for b in iter(lambda: f.read(1<<20), b''): h.update(b)\nprint(h.hexdigest())"
)
HASH_FUNCTION = (
    "_sha() { if command -v sha256sum >/dev/null 2>&1; then sha256sum <\"$1\" | cut -d' ' -f1; "
    f'elif command -v python3 >/dev/null 2>&1; then python3 -c {quote(_PY_SHA)} "$1"; '
    "elif command -v openssl >/dev/null 2>&1; then openssl dgst -sha256 -r <\"$1\" | cut -d' ' -f1; "
    f'else echo "{NO_HASH} $(hostname) has no sha256sum, python3 or openssl to verify what it receives" >&2; '
    "return 9; fi; }; "
)
HASH_TOOLS = ("sha256sum", "python3", "openssl")  # any one of them verifies


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def staging_check(folder: str) -> str:
    """Shell text: make `folder` (mode 0700, not -p) or accept it only if it is this login user's private folder;
    else print STAGING_REFUSED with the reason on stderr and exit 3."""
    return (
        f's={quote(folder)}; _no() {{ echo "{STAGING_REFUSED} $s on $(hostname) $*" >&2; exit 3; }}; '
        'if [ -L "$s" ] || { [ -e "$s" ] && [ ! -d "$s" ]; }; then _no "is a link or a file, not a folder"; fi; '
        '[ -d "$s" ] || mkdir -m 700 -- "$s" 2>/dev/null || [ -d "$s" ] || _no "cannot be made"; '
        '{ [ ! -L "$s" ] && [ -O "$s" ]; } || _no "belongs to $(stat -c %U "$s" 2>/dev/null), not to $(id -un)"; '
        'm=$(stat -c %a "$s"); [ "$m" = 700 ] || _no "has mode $m, not 700 (others may write in it)"; '
    )


def receive_command(archive: str, digest: str, use: str, source: str = "") -> str:
    """The receiver's script: the content on stdin (from the operator) or from `source` (`IP PORT` of a sender's
    listener; the copy's two secrets, ask then answer, on stdin); verified whole against `digest` (hex SHA-256),
    published, then `use` runs (shell text that reads "$a", the published file, and prints what the job checks).
    """
    start = (
        f"set -o pipefail; umask 077; {staging_check(folder_of(archive))}{HASH_FUNCTION}"
        f'a={quote(archive)}; p="$a.part"; f="$a.part.pid"; c=; '
        """trap '[ -n "$c" ] && kill "$c" 2>/dev/null; rm -f -- "$p" "$f"' EXIT; trap 'exit 143' TERM HUP INT; """
        'rm -f -- "$p" "$a"; '
    )
    copy = f'timeout -k 5 {DEADLINE_S:.0f} cat >"$p"'
    if source:
        address, port = source.split()
        dial = f"/dev/tcp/{address}/{port}"
        fetch = (
            "IFS= read -r ask; IFS= read -r answer; "
            f"end=$((SECONDS + {CONNECT_S:.0f})); "
            f"until timeout 5 bash -c {quote(f'exec 3<>{dial}')} 2>/dev/null; do "
            f'[ "$SECONDS" -lt "$end" ] || {{ echo "cannot reach {address}:{port}" >&2; exit 3; }}; sleep 0.3; done; '
            f"exec 3<>{dial}; "
            "printf '%s\\n' \"$ask\" >&3; "
            f'IFS= read -r -t {ANSWER_S:.0f} heard <&3 || heard=; [ -n "$answer" ] && [ "$heard" = "$answer" ] || '
            f'{{ echo "{SENDER_UNPROVEN} {address}:{port} did not answer with the copy\'s secret: nothing taken from it" >&2; '
            "exit 3; }; "
            f"{copy} <&3 & c=$!; exec 3<&-; "
        )
    else:
        # A background job's stdin is /dev/null unless redirected: hand it the content on fd 4.
        fetch = f"exec 4<&0; {copy} <&4 & c=$!; exec 4<&-; "
    check = (
        'echo "$c" >"$f"; wait "$c"; rc=$?; c=; rm -f -- "$f"; [ "$rc" = 0 ] || exit "$rc"; '
        'got=$(_sha "$p") || exit 9; '
        f'if [ "$got" != {quote(digest)} ]; then '
        f'echo "{CORRUPT} $(hostname): what arrived ($(stat -c %s "$p") bytes) has SHA-256 ${{got:0:16}}…, '
        f'not {digest[:16]}…: not used" >&2; exit {CORRUPT_RC}; fi; '
        f'mv -f -- "$p" "$a"; echo {quote(PUBLISHED)}; '
    )
    return start + fetch + check + use


def receive_script(command: str) -> str:
    """Receivers run under bash (for /dev/tcp and pipefail), whatever the login shell is."""
    return f"exec bash -c {quote(command)}"


def size_command(archive: str) -> str:
    """The bytes of the copy so far."""
    return f"stat -c %s {quote(archive + '.part')} 2>/dev/null || echo 0"


def stop_command(archive: str) -> str:
    """End a stalled copy: TERM to the receiver's `timeout` process, which passes it on to its `cat`. The pid file
    is read only when it is a plain file, as digits above 1 that name a live process called `timeout`: anything
    else (an empty file, `-1`, a pid reused by another program) is left alone."""
    pid = quote(archive + ".part.pid")
    return (
        f"[ -f {pid} ] && [ ! -L {pid} ] || exit 0; p=$(head -c 20 {pid}); "
        'case "$p" in ""|*[!0-9]*) exit 0;; esac; [ "$p" -gt 1 ] || exit 0; '
        '[ "$(cat /proc/$p/comm 2>/dev/null)" = timeout ] || exit 0; kill -TERM "$p" 2>/dev/null; true'
    )


def cleanup_command(archive: str) -> str:
    """Remove what a copy left in the staging folder (the published file, a partial one, its pid file), only when
    the folder is this login user's private one: never a file in a folder another user made (root may)."""
    folder = quote(folder_of(archive))
    return (
        f'[ -d {folder} ] && [ ! -L {folder} ] && [ -O {folder} ] && [ "$(stat -c %a {folder})" = 700 ] || exit 0; '
        f"rm -f -- {quote(archive)} {quote(archive + '.part')} {quote(archive + '.part.pid')}"
    )


def purge_command(folder: str) -> str:
    """`down --purge`: remove the staging folder when it is this login user's (never one another user made);
    prints `removed` when it was there."""
    q = quote(folder)
    return f"if [ -d {q} ] && [ ! -L {q} ] && [ -O {q} ]; then rm -rf -- {q} && echo removed; fi; true"
