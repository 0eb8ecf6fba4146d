"""atheris against the wire parsers: every byte a client, a worker or a daemon can send us.

    python tests/fuzz/wire.py --seconds 60           # bounded (make test runs tests/test_fuzz.py)
    python tests/fuzz/wire.py --seconds 3600         # make fuzz (FUZZ_SECONDS)
    python tests/fuzz/wire.py --replay FILE...       # run inputs once each (the crash test)

One input is one message: a msgpack list of frames when it decodes as one (the seeds are, so
mutations keep that structure), otherwise ``[SIGNATURE, input]``, a bare header frame. Each
message goes through what the supervisor does to a client's frames (frame and byte limits,
the envelope, the strict header parse, the infer header's schema, frame lengths, str/bytes
elements) and what a client does to a daemon's reply (split, the reply's schema, its elements).
The input's raw bytes are also what a peer wrote on a link (shared/link.py): read by the
supervisor's end of a worker link, by a worker's end, and by a local frontend's connection
reading a client (``unix://``), they must give the same messages, the same end (the peer's
close) and the same refusal compiled and uncompiled. And they are what a ZeroMQ client wrote to
an ``ipc://`` frontend (ZMTP, shared/zmtp.py), read from the greeting on and after a DEALER's
handshake: the same messages (or the same read-past message), end, refusal and peer type.
The only acceptable outcome of bad bytes is ProtocolError (InternalError from the client's
splitter): anything else raised, a hang (libFuzzer's -timeout) or a crash of the process is a
finding. libFuzzer writes each to tests/fuzz/crashes/, which tests/test_fuzz.py replays for
ever after.

Compiled and uncompiled, side by side. atheris instruments Python bytecode; a module compiled by
Cython is C that gcc built without libFuzzer's coverage hooks, so on its own the compiled path
gives the fuzzer nothing to steer by. Each input therefore runs twice: through the modules this
process imports (compiled after ``make install``) and through a second, uncompiled copy of the
same sources loaded under other names and instrumented (``PURE``). The copy's coverage steers
the mutations; the compiled modules must never crash, and both must end the same way: the same
summary of what was parsed, or the same error class and message. A difference is a finding too
(the compiled source behaving unlike the source).

Every header frame is also read by msgpack-python, the reference implementation of the format,
under the same limits: shared/mpack.py must read the same value from it or refuse it too. And
the supervisor's InferCache and the client's ReplyCache must find only what the full parse of a
header gives.

The seeds are valid requests and replies of every kind plus the hostile inputs of the
malformed-input tests: msgpack bombs (huge declared counts, deep nesting), overflowing shapes,
counts that disagree, length prefixes past the end, invalid UTF-8, too many frames.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import atheris
import msgpack

HERE = Path(__file__).resolve().parent
CRASHES = HERE / "crashes"
WORK = HERE / "work"  # the growing corpus of `make fuzz` (git-ignored)
MAX_BYTES = 1 << 20  # max_message_bytes for the fuzz run: big enough, never a real allocation

import socket  # noqa: E402

from modelwarden.shared import descriptors, link, mpack, protocol, zmtp  # noqa: E402  (as installed: compiled)
from modelwarden.shared.errors import InternalError  # noqa: E402
from modelwarden.supervisor.routing import limits  # noqa: E402
from modelwarden.supervisor.routing.localfront import BUFFER_BYTES as LOCAL_BUFFER_BYTES  # noqa: E402
from modelwarden.supervisor.routing.zmtpfront import PEER_TYPES  # noqa: E402

ROOT = HERE.parent.parent
# The uncompiled copy, in import order: each module's imports of the others are renamed.
PURE_SOURCES = {"modelwarden.shared.mpack": "shared/mpack.py",
                "modelwarden.shared.protocol": "shared/protocol.py",
                "modelwarden.shared.descriptors": "shared/descriptors.py",
                "modelwarden.supervisor.routing.limits": "supervisor/routing/limits.py",
                "modelwarden.shared.link": "shared/link.py",
                "modelwarden.shared.zmtp": "shared/zmtp.py"}


def load_pure() -> types.SimpleNamespace:
    """The modules of PURE_SOURCES compiled by Python from their .py files, as ``mwpure_*``."""
    aliases = {name: "mwpure_" + name.rpartition(".")[2] for name in PURE_SOURCES}
    loaded = {}
    for name, path in PURE_SOURCES.items():
        source = (ROOT / path).read_text()
        for real, alias in aliases.items():
            source = source.replace(real, alias)
        module = types.ModuleType(aliases[name])
        module.__file__ = str(ROOT / path)
        sys.modules[aliases[name]] = module  # dataclasses look their module up while executing it
        exec(compile(source, str(ROOT / path), "exec"), module.__dict__)
        loaded[name.rpartition(".")[2]] = module
    return types.SimpleNamespace(**loaded)


COMPILED_PATH = types.SimpleNamespace(mpack=mpack, protocol=protocol, descriptors=descriptors,
                                      limits=limits, link=link, zmtp=zmtp)
PURE = load_pure()


def frames_of(data: bytes) -> list[bytes]:
    try:
        frames = msgpack.unpackb(data, max_array_len=4096)  # inputs are at most -max_len bytes
    except Exception:
        frames = None
    if isinstance(frames, list) and all(isinstance(frame, bytes) for frame in frames):
        return frames
    return [protocol.SIGNATURE, data]


def as_client_request(path: types.SimpleNamespace, frames: list[bytes]) -> tuple:
    """The supervisor's reading of a client's message (router.py, in the same order)."""
    protocol, descriptors = path.protocol, path.descriptors
    message = [b"client-identity", *frames]
    path.limits.check_message(message, MAX_BYTES)
    envelope = protocol.split_router_message(message)
    header = protocol.unpack_header(envelope.header)
    if header.get("type", protocol.INFER) != protocol.INFER:
        return ("not infer", repr(header.get("type")))
    request = protocol.parse_infer(header, len(envelope.payload))
    protocol.frame_lengths_match(request.tensors, envelope.payload)
    elements = [repr(descriptors.decode_elements(memoryview(envelope.payload[desc.frame]), desc))
                for desc in request.tensors
                if desc.dtype in protocol.ELEMENT_TYPES and desc.frame is not None]
    return (repr(request.id), request.model, [tuple(desc) for desc in request.tensors],
            request.timeout_ms, request.out, elements)


def as_reply(path: types.SimpleNamespace, frames: list[bytes]) -> tuple:
    """A client's reading of a daemon's (or a worker's) reply."""
    protocol, descriptors = path.protocol, path.descriptors
    header, payload = protocol.split_reply(frames)
    reply = descriptors.parse_reply(header, payload, shm=False)
    elements = [repr(descriptors.decode_elements(memoryview(payload[desc.frame]), desc))
                for desc in reply.tensors
                if desc.dtype in protocol.ELEMENT_TYPES and desc.frame is not None]
    return (repr(reply.id), reply.ok, [tuple(desc) for desc in reply.tensors],
            repr(reply.error), elements)


def outcome(reader, path: types.SimpleNamespace, frames: list[bytes]) -> tuple:
    """What became of the frames: ("ok", summary) or ("error", class name, message). Any other
    exception propagates: that is the finding."""
    try:
        return ("ok", reader(path, frames))
    except (COMPILED_PATH.protocol.ProtocolError, PURE.protocol.ProtocolError, InternalError) as exc:
        return ("error", type(exc).__name__, str(exc))


def against_msgpack(frame: bytes) -> None:
    """Our msgpack reader (shared/mpack.py) against msgpack-python, the reference, under the
    same limits: the same value, or both refuse. Ours refuses more in two ways only: nesting
    past mpack.MAX_DEPTH, and an ext of length 0 (msgpack's max_ext_len=0 lets that one by)."""
    try:
        reference = ("ok", repr(msgpack.unpackb(frame, **REFERENCE_LIMITS)))
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        reference = ("refused", type(exc).__name__)
    try:
        ours = ("ok", repr(mpack.unpack(frame, False, *OUR_LIMITS)))
    except mpack.Malformed as exc:
        if exc.reason == "StackError" or (exc.reason.startswith("ext") and "ExtType" in reference[-1]):
            return
        ours = ("refused", exc.reason)
    if reference[0] != ours[0] or (ours[0] == "ok" and ours != reference):
        raise AssertionError(f"msgpack-python {reference!r} but mpack {ours!r}")


# protocol.unpack_header's limits, in msgpack-python's words and in ours
OUR_LIMITS = (protocol.MAX_HEADER_BYTES, protocol.MAX_ID_BYTES, 4 * protocol.MAX_TENSORS)
REFERENCE_LIMITS = dict(max_str_len=OUR_LIMITS[0], max_bin_len=OUR_LIMITS[1],
                        max_array_len=OUR_LIMITS[2], max_map_len=OUR_LIMITS[2], max_ext_len=0,
                        raw=False, strict_map_key=True, use_list=True)


def cache_agrees(frames: list[bytes]) -> None:
    """The supervisor's InferCache (shared/protocol.py) against the full parse it stands for:
    what it finds for a header, the full parse gives too; what the full parse refuses, it never
    finds. It learns every header the full parse accepts, so the inputs that follow (the corpus
    is full of near-copies) are looked up against templates the fuzzer made itself."""
    if len(frames) < 2:
        return
    header, count = frames[1], len(frames) - 2
    found = CACHE.parse(header, count)
    try:
        parsed = protocol.parse_infer(protocol.unpack_header(header), count)
    except protocol.ProtocolError:
        if found is not None:
            raise AssertionError("the cache found a header the full parse refuses") from None
        return
    if found is not None and (found.id, found.model, found.tree, found.tensors, found.timeout_ms,
                              found.out) != (parsed.id, parsed.model, parsed.tree, parsed.tensors,
                                             parsed.timeout_ms, parsed.out):
        raise AssertionError("the cache and the full parse disagree")
    CACHE.learn(header, parsed, count)


CACHE = protocol.InferCache()


def reply_cache_agrees(frames: list[bytes]) -> None:
    """The client's ReplyCache (shared/descriptors.py) against the full parse it stands for, as
    cache_agrees does for the InferCache: found means the full parse gives the same id and reply;
    refused by the full parse means never found."""
    try:
        header, payload = protocol.reply_parts(frames)
    except InternalError:
        return
    found = REPLIES.parse(header, payload)
    try:
        decoded = protocol.unpack_header(header, strict=False)
        parsed = descriptors.parse_reply(decoded, payload)
    except protocol.ProtocolError:
        if found is not None:
            raise AssertionError("the reply cache found a header the full parse refuses") from None
        return
    if found is not None and found != (decoded.get("id"), parsed):
        raise AssertionError(f"the reply cache found {found!r} but the full parse gives "
                             f"{(decoded.get('id'), parsed)!r}")
    REPLIES.learn(header, len(decoded), parsed, len(payload))


REPLIES = descriptors.ReplyCache()


def result_reader_agrees(frames: list[bytes]) -> None:
    """protocol.read_result (the supervisor's read of a worker's success envelope, in place)
    against the full decode it stands for: what it reads, the decode gives too."""
    for frame in frames[1:2]:
        found = protocol.read_result(frame)
        if found is None:
            continue
        try:
            decoded = protocol.unpack_header(frame, strict=False)
        except protocol.ProtocolError:
            raise AssertionError("read_result read an envelope the full decode refuses") from None
        if found != decoded or list(found) != list(decoded):
            raise AssertionError(f"read_result gives {found!r}, the full decode {decoded!r}")


# The link kinds that read untrusted bytes: (writable, the Link's bounds). The supervisor's end
# of a worker link, a worker's end, and a local frontend's connection reading a client
# (supervisor/routing/localfront.py: at most MAX_FRAMES parts, a small buffer that grows).
LINK_KINDS = {"supervisor": (False, {}), "worker": (True, {}),
              "local client": (False, {"max_parts": limits.MAX_FRAMES,
                                       "buffer_bytes": LOCAL_BUFFER_BYTES, "send_buffer": None})}


def as_link_stream(path: types.SimpleNamespace, data: bytes, kind: str) -> tuple:
    """What one end of a link of ``kind`` reads of ``data``, written by its peer, which then
    closes: the messages (each part's bytes), whether it saw the close, and its refusal if any."""
    writable, bounds = LINK_KINDS[kind]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        theirs.sendall(data)  # at most -max_len bytes: the socket's buffer takes them whole
        theirs.close()
        end = path.link.Link(ours, writable=writable, max_bytes=MAX_BYTES, **bounds)
        messages = []
        for _ in range(1000):  # every read makes progress; a loop that does not is a finding
            messages += [[bytes(part) for part in message] for message in end.receive()]
            if end.eof or end.broken:
                return (messages, end.eof, end.error)
        raise AssertionError("the link read neither to the end nor to a refusal")
    finally:
        ours.close()


# An ipc:// frontend's connection reading a client (supervisor/routing/zmtpfront.py): from its
# first byte (the greeting), and after a libzmq DEALER's greeting and READY (messages, commands).
ZMTP_KINDS = {"zmtp client": b"", "zmtp client, handshaken": None}


def as_zmtp_stream(path: types.SimpleNamespace, data: bytes, kind: str) -> tuple:
    """What an ipc:// frontend's ZMTP connection reads of ``data`` (after a DEALER's handshake
    for the handshaken kind), written by a client which then closes: the messages (each frame's
    bytes; a message read past, the tuple that says so), whether it saw the close, its refusal."""
    prefix = ZMTP_KINDS[kind]
    if prefix is None:
        prefix = path.zmtp.greeting() + path.zmtp.ready(b"DEALER")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        end = path.zmtp.ZmtpLink(ours, b"ROUTER", PEER_TYPES, max_bytes=MAX_BYTES,
                                 max_parts=limits.MAX_FRAMES, buffer_bytes=LOCAL_BUFFER_BYTES)
        end.greet()
        theirs.recv(4096)  # our greeting and READY: a close with unread bytes is a reset
        theirs.sendall(prefix + data)
        theirs.close()
        messages = []
        for _ in range(1000):  # every read makes progress; a loop that does not is a finding
            messages += [message if type(message) is tuple else [bytes(part) for part in message]
                         for message in end.receive()]
            if end.eof or end.broken:
                return (messages, end.eof, end.error, end.peer_type)
        raise AssertionError("the ZMTP connection read neither to the end nor to a refusal")
    finally:
        ours.close()


# Every reader of a byte stream, by kind: (the kind, the reader).
STREAM_READERS = ([(kind, as_link_stream) for kind in LINK_KINDS]
                  + [(kind, as_zmtp_stream) for kind in ZMTP_KINDS])


def one_input(data: bytes) -> None:
    for kind, read in STREAM_READERS:
        compiled = read(COMPILED_PATH, data, kind)
        pure = read(PURE, data, kind)
        if compiled != pure:
            raise AssertionError(f"{kind}: compiled {compiled!r} but uncompiled {pure!r}")
    frames = frames_of(data)
    for reader in (as_client_request, as_reply):
        compiled = outcome(reader, COMPILED_PATH, frames)
        pure = outcome(reader, PURE, frames)
        if compiled != pure:
            raise AssertionError(f"{reader.__name__}: compiled {compiled!r} but uncompiled {pure!r}")
    for frame in frames[1:2]:  # the header frame
        against_msgpack(frame)
    cache_agrees(frames)
    reply_cache_agrees(frames)
    result_reader_agrees(frames)


# -- seeds -----------------------------------------------------------------------------------


def _message(header, *payload: bytes, raw: bytes | None = None) -> bytes:
    head = raw if raw is not None else msgpack.packb(header)
    return msgpack.packb([protocol.SIGNATURE, head, *payload])


def _elements(items: list[bytes]) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def seeds() -> list[bytes]:
    f32 = bytes(16)
    words = [b"hello", "w\u00f6rld".encode(), b""]
    text = _elements(words)
    infer = {"type": "infer", "id": 7, "model": "m", "inputs": 0,
             "tensors": [{"dtype": "float32", "shape": [2, 2], "frame": 0}]}
    strings = {"type": "infer", "id": "s", "model": "bert", "inputs": {"dict": {"texts": 0}},
               "tensors": [{"dtype": "str", "shape": [3], "frame": 0, "nbytes": len(text),
                            "longest": 6}]}
    shm = {"type": "infer", "id": 8, "model": "m", "inputs": [0, {"tuple": [1]}],
           "tensors": [{"dtype": "int64", "shape": [4], "shm": ["0123456789abcdef" * 2, 0, 32]},
                       {"dtype": "bfloat16", "shape": [], "frame": 0}],
           "out": ["fedcba9876543210" * 2, 0, 4096], "timeout_ms": 1000}
    reply = {"ok": True, "id": 7, "outputs": 0, "worker": "m#0", "version": "v1",
             "timing": {"queue_us": 1, "forward_us": 2},
             "tensors": [{"dtype": "float32", "shape": [2, 2], "frame": 0}]}
    failure = {"ok": False, "id": 7, "error": {"code": "BAD_INPUT", "message": "no"}}
    # as the daemon writes a success: the worker's map, id first, and the supervisor's timing
    relayed = protocol.add_timing(msgpack.packb({
        "id": 9, "ok": True, "outputs": 0, "worker": "m#0", "version": "v1",
        "tensors": [{"dtype": "float32", "shape": [2, 2], "frame": 0}]}), 3, 250, 900, 1)
    hostile = [
        # msgpack bombs: declared counts far past the bytes that follow, nesting past the limit
        _message(None, raw=b"\xdf\xff\xff\xff\xff"),
        _message(None, raw=b"\xdd\xff\xff\xff\xff"),
        _message(None, raw=b"\x91" * 5000),
        _message(None, raw=b"\xdb\xff\xff\xff\xf0"),
        # shapes whose product overflows, negative dims, too many dims
        _message({**infer, "tensors": [{"dtype": "float32", "shape": [2**62, 2**62], "frame": 0}]}, f32),
        _message({**infer, "tensors": [{"dtype": "float32", "shape": [-1, 4], "frame": 0}]}, f32),
        _message({**infer, "tensors": [{"dtype": "uint8", "shape": [1] * 40, "frame": 0}]}, b"x"),
        # counts that disagree: tensors vs frames, frame length vs dtype x shape
        _message(infer, f32, f32),
        _message(infer, f32[:15]),
        # str elements: a prefix past the end, invalid UTF-8, bytes left over, a wrong longest
        _message(strings, text[:-1]),
        _message({**strings, "tensors": [{**strings["tensors"][0], "shape": [1], "nbytes": 9,
                                          "longest": 5}]},
                 _elements([b"\xff\xfe\xfd\xfc\xfb"])),
        _message(strings, text + b"\x00"),
        _message({**strings, "tensors": [{**strings["tensors"][0], "longest": 1}]}, text),
        _message({**strings, "tensors": [{"dtype": "bytes", "shape": [10**6], "frame": 0,
                                          "nbytes": 4 * 10**6, "longest": 0}]}, b"\x00" * 64),
        # a tree that names a tensor twice, keys that are not str, a repeated key
        _message({**infer, "inputs": [0, 0]}, f32),
        _message(None, raw=b"\x82\x01\x01\xa2id\x01"),
        _message(None, raw=b"\x82\xa2id\x01\xa2id\x02"),
        # too many frames, a bad signature, nothing at all
        msgpack.packb([protocol.SIGNATURE, msgpack.packb(infer)] + [b""] * 1100),
        msgpack.packb([b"MWP0", msgpack.packb(infer), f32]),
        msgpack.packb([]),
    ]
    streams = [  # worker links: whole messages, then ones cut short, declared past the limit
        b"".join(link.frame_prefix(parts) + b"".join(parts) for parts in (
            [msgpack.packb({"type": "result", "rid": 1, "ok": True, "compute_us": 5, "batch": 1}),
             msgpack.packb({"id": 1, "ok": True}), f32],
            [msgpack.packb({"type": "heartbeat"})], [b"", b"x" * 70_000, b""])),
        link.frame_prefix([f32, f32]) + f32,
        b"\x00\x00\x00\x00",
        link.frame_prefix([b"a"])[:4] + (MAX_BYTES + 1).to_bytes(8, "little"),
        (1 << 21).to_bytes(4, "little"),
    ]
    handshake = zmtp.greeting() + zmtp.ready(b"DEALER")
    request = [protocol.SIGNATURE, msgpack.packb(infer), f32]
    zmtp_streams = [  # ipc:// frontends: a handshake then messages, commands, bounds
        handshake + b"".join(b"".join(zmtp.framed(parts)) for parts in (
            request, [b"", *request], [b"x" * 300, b""])),
        handshake + zmtp.command(b"PING", b"\x00\x0actx") + zmtp.command(b"PONG", b""),
        b"".join(b"".join(zmtp.framed(parts)) for parts in (request, [b"y" * 70_000])),
        bytes([zmtp.LONG]) + (MAX_BYTES + 1).to_bytes(8, "big"),
        b"".join(zmtp.frame_head(zmtp.MORE, 0) for _ in range(limits.MAX_FRAMES + 2)) + b"\x00\x00",
        handshake[:12] + b"CURVE".ljust(20, b"\0") + handshake[32:],
        handshake[:64] + zmtp.ready(b"PUB"),
    ]
    valid = [_message(infer, f32), _message(strings, text), _message(shm, b"\x00\x00"),
             _message(reply, f32), _message(None, f32, raw=relayed), _message(failure), _message({"type": "hello", "id": "h"}),
             _message({"type": "result", "rid": 70000, "ok": True, "compute_us": 250, "batch": 1}, raw=None)]
    return valid + hostile + streams + zmtp_streams


def replay(paths: list[Path]) -> int:
    for path in paths:
        one_input(path.read_bytes())
    print(f"replayed {len(paths)} input(s): only typed errors")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--replay", nargs="*", type=Path)
    args = parser.parse_args()
    if args.replay is not None:
        return replay(args.replay or sorted(CRASHES.glob("*")))
    WORK.mkdir(exist_ok=True)
    for index, seed in enumerate(seeds()):
        (WORK / f"seed-{index:03d}").write_bytes(seed)
    CRASHES.mkdir(exist_ok=True)
    atheris.instrument_all()  # the uncompiled copy, and what it calls in Python
    atheris.Setup([sys.argv[0], str(WORK), f"-max_total_time={args.seconds}", "-timeout=10",
                   "-rss_limit_mb=2048", "-max_len=65536", f"-artifact_prefix={CRASHES}/",
                   "-print_final_stats=1"], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
