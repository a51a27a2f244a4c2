#!/bin/sh
# Run "$@" in a private network namespace with its loopback up and an isolated
# veth pair (simhost0 <-> simhost1, 10.77.0.1/24 on simhost0): PRRTE never uses a
# loopback interface between daemons, and the machine's real interfaces must not
# be touched.  Nothing in the namespace can reach outside it.  Needs root.
exec unshare --net /bin/sh -c '
    ip link set lo up &&
    ip link add simhost0 type veth peer name simhost1 &&
    ip addr add 10.77.0.1/24 dev simhost0 &&
    ip link set simhost0 up && ip link set simhost1 up &&
    exec "$@"' sh "$@"
