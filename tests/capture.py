"""A packet capture for tests, with no tcpdump: ``python -m tests.capture IFACE OUT STOP`` reads
every frame on IFACE (a raw AF_PACKET socket, so it must run as root inside the interface's
network namespace) and appends the TCP payloads to OUT until the file STOP exists. It prints
"capturing" once the socket is bound, so the caller knows nothing is missed after that."""

from __future__ import annotations

import os
import socket
import struct
import sys

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800


def tcp_payload(frame: bytes) -> tuple[int, int, bytes] | None:
    """(source port, destination port, payload) of an IPv4 TCP frame, else None."""
    if len(frame) < 34 or struct.unpack("!H", frame[12:14])[0] != ETH_P_IP:
        return None
    ip = frame[14:]
    header_length = (ip[0] & 0x0F) * 4
    total_length = struct.unpack("!H", ip[2:4])[0]
    if ip[9] != socket.IPPROTO_TCP:
        return None
    tcp = ip[header_length:total_length]
    source, destination = struct.unpack("!HH", tcp[:4])
    offset = (tcp[12] >> 4) * 4
    return source, destination, tcp[offset:]


def main() -> None:
    interface, out_path, stop_path = sys.argv[1:4]
    capture = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    capture.bind((interface, 0))
    capture.settimeout(0.1)
    print("capturing", flush=True)
    with open(out_path, "wb") as out:
        while not os.path.exists(stop_path):
            try:
                frame = capture.recv(65535)
            except TimeoutError:
                continue
            found = tcp_payload(frame)
            if found and found[2]:
                source, destination, payload = found
                out.write(struct.pack("!HHI", source, destination, len(payload)) + payload)


if __name__ == "__main__":
    main()
