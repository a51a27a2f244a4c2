#!/bin/sh
# PRRTE's "ssh" for simulated hosts (plm_ssh_agent): called as `agent.sh [options]
# HOST COMMAND...`, it runs COMMAND here, as ssh would run it on HOST, inside a UTS
# namespace whose hostname is HOST.  Each simulated host thus has its own prted
# and its own hostname; processes, files and memory stay shared.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
host="$1"
shift
exec unshare --uts /bin/sh -c 'hostname "$1" && exec /bin/sh -c "$2"' sh "$host" "$*"
