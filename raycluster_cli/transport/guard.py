"""Remote commands that die with their connection: a small POSIX-sh guard around every command we run.

sshd does not end a command when its client goes away: without a terminal, a `docker load` whose client
was interrupted, or whose connection was cut, waits on its stdin until sshd notices — hours later with
default TCP keepalives. (A pty would deliver SIGHUP, but it mangles binary stdin and merges stderr.)
The guard runs the command in the background of the session's shell and watches it once a second:

- the sshd process that started the session is gone (the connection closed or died): end the command;
- the command ran `deadline` seconds (the client's own deadline plus a margin): end it;
- with `idle` > 0 (a stream on stdin): stdin passes through a relay (`cat` into a fifo) whose read count
  shows progress; no byte for `idle` seconds (the client stalled or the network was cut) ends it;
- with a heartbeat (`exec`, `logs`: long commands without stdin): the client writes a byte every few
  seconds; a relay (`cat` to /dev/null) reads them; none for the heartbeat deadline (the connection was
  cut, and sshd, without ClientAlive settings, would keep the session for hours) ends it.

"End" is SIGTERM to the session's whole process group (sshd made it a group of its own), SIGKILL 2 s
later. Processes that detach on purpose (`setsid`, `docker run -d`) are not affected.
"""

from __future__ import annotations

from raycluster_cli.transport.base import quote

MARGIN_S = 30  # the guard's deadline = the client's deadline + this: the client reports first

_SCRIPT = r"""
d=$1 i=$2 c=$3 h=${4:-0} p=$PPID f=
exec 3<&0
if [ "$h" -gt 0 ]; then
  sh -c "$c" </dev/null 3<&- &
  k=$!
  cat <&3 >/dev/null 3<&- &
  r=$! i=$h
elif [ "$i" -gt 0 ] && f=$(mktemp -u /tmp/.raycluster-in.XXXXXX) && mkfifo -m 600 "$f"; then
  sh -c "$c" <"$f" 3<&- &
  k=$!
  cat <&3 >"$f" 3<&- &
  r=$!
else
  i=0 r=
  sh -c "$c" <&3 3<&- &
  k=$!
fi
exec 3<&- </dev/null
(
  t=0 n=0 last=-1
  while kill -0 "$k" 2>/dev/null; do
    sleep 1
    t=$((t + 1))
    q=$(cut -d' ' -f4 "/proc/$$/stat" 2>/dev/null) || q=$p
    why=
    [ "$q" = "$p" ] || why=gone
    [ "$d" -gt 0 ] && [ "$t" -gt "$d" ] && why=deadline
    if [ -n "$r" ]; then
      st=$(cut -d' ' -f3 "/proc/$r/stat" 2>/dev/null)
      if [ -z "$st" ] || [ "$st" = Z ]; then
        r=
      elif x=$(sed -n 's/^rchar: //p' "/proc/$r/io" 2>/dev/null) && [ -n "$x" ]; then
        if [ "$x" = "$last" ]; then n=$((n + 1)); else n=0 last=$x; fi
        [ "$n" -gt "$i" ] && why=idle
      fi
    fi
    if [ -n "$why" ]; then
      [ -n "$f" ] && rm -f "$f"
      trap '' TERM
      kill -TERM 0
      sleep 2
      kill -KILL 0
    fi
  done
) >/dev/null 2>&1 &
w=$!
wait "$k"
s=$?
kill "$w" 2>/dev/null
[ "$h" -gt 0 ] && kill "$r" 2>/dev/null
[ -n "$f" ] && rm -f "$f"
exit "$s"
"""


def guarded(
    command: str, deadline_s: float | None, idle_s: float | None = None, heartbeat_s: float | None = None
) -> str:
    """`command` wrapped so that it ends with its connection, at its deadline, or when its stdin stalls.

    With `heartbeat_s`, the command's stdin is /dev/null and the session's stdin carries the client's
    heartbeat instead (transport/ssh.py sends a byte every HEARTBEAT_S): no byte for `heartbeat_s` (+ a
    margin) — the connection was cut, sshd has not noticed — ends the command."""
    deadline = 0 if deadline_s is None else int(deadline_s) + MARGIN_S
    idle = 0 if idle_s is None else int(idle_s) + MARGIN_S // 3
    beat = 0 if heartbeat_s is None else int(heartbeat_s) + MARGIN_S // 3
    return "exec sh -c " + quote(_SCRIPT.strip()) + " raycluster-guard " + quote(deadline, idle, command, beat)
