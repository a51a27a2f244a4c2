"""A rank that reports where the launcher's state keeper listens, as the kernel has it
(/proc/net/tcp, tcp6): the addresses of the listening sockets on the keeper's port.

    elastic-hvd-run -np 1 python keeper_address.py
"""

import os
import socket

import report
from elastic_hvd import state_replica

port = int(os.environ[state_replica.ADDRESS_ENV].rpartition(":")[2])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words, each little-endian
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                listening.append(socket.inet_ntop(family, raw))
report.write(0, listening=listening, advertised=os.environ[state_replica.ADDRESS_ENV])
