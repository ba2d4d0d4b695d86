#!/usr/bin/env bash
# Print the Debian mirror that this machine's apt uses, for debootstrap: a machine behind a local mirror
# builds from that mirror, and no mirror's name is written into the project.
#   DEBIAN_MIRROR=URL   use URL, read nothing
#   APT_DIR=DIR         read DIR instead of /etc/apt (tests)
# Read, in order: sources.list.d/*.sources (deb822 stanzas: Types, URIs, Suites, Enabled), then
# sources.list and sources.list.d/*.list (one-line "deb [options] URI suite components"). The first URI
# of an enabled `deb` source with a suite other than the security archive's wins (the security archive
# is a different tree); only http, https, ftp and file URIs (what debootstrap fetches from) count.
set -euo pipefail
if [ -n "${DEBIAN_MIRROR:-}" ]; then
  echo "$DEBIAN_MIRROR"
  exit 0
fi
apt_dir=${APT_DIR:-/etc/apt}
shopt -s nullglob
deb822=("$apt_dir"/sources.list.d/*.sources)
oneline=()
[ -f "$apt_dir/sources.list" ] && oneline+=("$apt_dir/sources.list")
oneline+=("$apt_dir"/sources.list.d/*.list)

# Shared by both formats: is this suite list / URI usable?
common='
function main_suite(suites,   n, i, s) {
  n = split(suites, s, /[ \t]+/)
  for (i = 1; i <= n; i++) if (s[i] != "" && s[i] !~ /-security$/ && s[i] !~ /\/updates$/) return 1
  return 0
}
function usable(uri) { return uri ~ /^(https?|ftp|file):\/\// }
'
mirror=""
if [ ${#deb822[@]} -gt 0 ]; then
  mirror=$(awk "$common"'
    BEGIN { RS = ""; FS = "\n" }
    {
      types = ""; uris = ""; suites = ""; enabled = "yes"; key = ""
      for (i = 1; i <= NF; i++) {
        line = $i
        if (line ~ /^#/) continue
        if (match(line, /^[A-Za-z0-9-]+:/)) { key = tolower(substr(line, 1, RLENGTH - 1)); val = substr(line, RLENGTH + 1) }
        else if (line ~ /^[ \t]/) val = line
        else continue
        if (key == "types") types = types " " val
        else if (key == "uris") uris = uris " " val
        else if (key == "suites") suites = suites " " val
        else if (key == "enabled") enabled = tolower(val)
      }
      if ((types " ") !~ /[ \t]deb[ \t]/ || enabled ~ /no/ || !main_suite(suites)) next
      n = split(uris, u, /[ \t]+/)
      for (j = 1; j <= n; j++) if (usable(u[j])) { print u[j]; exit }
    }' "${deb822[@]}")
fi
if [ -z "$mirror" ] && [ ${#oneline[@]} -gt 0 ]; then
  mirror=$(awk "$common"'
    /^[ \t]*deb[ \t]/ {
      line = $0
      sub(/#.*/, "", line)
      gsub(/\[[^]]*\]/, " ", line)
      n = split(line, w, /[ \t]+/)
      start = (w[1] == "") ? 2 : 1
      if (usable(w[start + 1]) && main_suite(w[start + 2])) { print w[start + 1]; exit }
    }' "${oneline[@]}")
fi
if [ -z "$mirror" ]; then
  echo "debian-mirror: no Debian mirror (a deb source with an http/https/ftp/file URI) in $apt_dir/sources.list.d/*.sources," \
    "$apt_dir/sources.list or $apt_dir/sources.list.d/*.list; set DEBIAN_MIRROR=URL" >&2
  exit 1
fi
echo "$mirror"
