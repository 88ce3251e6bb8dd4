"""Sealed pages: raw page bytes with a checksum bound to their key, for any engine.

`encode_page` / `decode_page` store pages of kvtier's own host pools. An engine
that keeps its own host memory (SGLang's host pools, a custom runtime) hands
kvtier plain bytes instead; this module gives those bytes the same guarantee:
a page that changed in the store, was cut short, or was written under another
key (a store bug, a migration, a copy tool, another backend's format) is told
apart from the page that was stored, before a byte of it is used.

* `EngineNamespace`: what must match for two engines to share a page (the
  engine, the model, its tensor-parallel rank, dtype, layout and page size).
  `EngineNamespace.key` turns a key the engine already hashed (SGLang's
  per-page SHA-256 hex chain, vLLM's block hashes) into a 32-byte kvtier page
  key in that namespace; change any field and every key changes. It is
  defined in `kvtier.storage.identity`, beside the other key roots.
* `seal` / `seal_tensor` / `seal_in_place`: a blob of `SEAL_HEADER_BYTES` of
  header, then the payload. `open_sealed` checks a blob against the key and
  the identity tag it was read under and returns the payload (a view, no
  copy), or raises `SealBroken` naming the rule it broke.

The header (little-endian)::

    0   4  b"KVTS", kvtier's sealed-blob tag
    4   1  format version (2)
    5   3  zero
    8   8  payload length in bytes
    16  8  the payload's identity tag: 8 bytes the caller gives (`PageIdentity.tag`
           of the page's pool), or xxh3-64 of a tag string
    24  8  checksum: xxh3-64 over the key (length-prefixed), header bytes 0..23 and the payload

The identity tag says what the bytes mean (model, pool, format, geometry,
shard): a blob read under another identity is refused before its checksum
is looked at (rule ``"identity"``). The checksum covers the key, so the same
bytes stored under another key fail it: a blob is valid only where it was
written. Version 1 blobs (whose tag was the pool name alone) read as rule
``"version"``: a miss, repaired by the next write. xxh3-64 (the ``xxhash``
package) runs at memory speed; it guards against accidents, not an attacker.

Everything here is synchronous and hashes memory: call it from a worker
thread or the engine's own I/O thread, never on an event loop.
"""

from __future__ import annotations

import struct

import numpy
import torch
import xxhash

from kvtier.errors import ConfigurationError, KvtierError
from kvtier.storage.base import Buffer, check_key
from kvtier.storage.errors import StorageError
from kvtier.storage.identity import EngineNamespace

__all__ = [
    "SEAL_HEADER_BYTES",
    "EngineNamespace",
    "SealBroken",
    "TAG_BYTES",
    "UnsupportedPayload",
    "new_sealed",
    "open_sealed",
    "seal",
    "seal_in_place",
    "seal_tensor",
]

_HEADER = struct.Struct("<4sB3sQ8s8s")
SEAL_HEADER_BYTES = _HEADER.size
"""Bytes of the header before a sealed blob's payload (32)."""
_MAGIC = b"KVTS"
_VERSION = 2  # 2: the tag field carries the page's identity (1: a tag string, the pool name)
_CHECKED = 24  # header bytes the checksum covers: all but the checksum itself


class SealBroken(StorageError):
    """A sealed blob failed `open_sealed`'s checks; its payload must not be used.

    ``rule`` says which check: ``"header"`` (not a sealed blob: too short or
    another format), ``"version"`` (a format this kvtier does not read),
    ``"identity"`` (sealed under another identity tag: another model, pool,
    format, geometry or shard), ``"length"`` (the payload is cut short,
    extended, or not the length the caller expects), ``"checksum"`` (the bytes
    changed, or the blob was sealed under another key). ``key`` is the key it
    was opened with. ``operation`` is ``"open"``.
    """

    def __init__(self, message: str, *, rule: str, key: bytes) -> None:
        super().__init__(message, operation="open")
        self.rule = rule
        self.key = key


class UnsupportedPayload(KvtierError, TypeError):
    """A page payload that cannot be sealed: neither a bytes-like object with
    one contiguous buffer (``bytes``, ``bytearray``, a contiguous
    ``memoryview``, a numpy array) nor a CPU tensor. ``value_type`` names what
    was given. Raised before anything is sealed or stored.
    """

    def __init__(self, message: str, *, value_type: str) -> None:
        super().__init__(message)
        self.value_type = value_type


_PAYLOADS = "a page payload is bytes-like with one contiguous buffer (bytes, bytearray, memoryview, numpy array) or a CPU tensor"


def _payload_view(payload: object, what: str = "the payload") -> memoryview:
    """``payload``'s bytes as a flat byte view (no copy), or `UnsupportedPayload` naming its type."""
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise UnsupportedPayload(
            f"{what} is a {type(payload).__name__}: {_PAYLOADS}", value_type=type(payload).__name__
        ) from None
    if not view.c_contiguous:
        raise UnsupportedPayload(
            f"{what} is a memoryview that is not contiguous (shape {view.shape}, strides {view.strides}): {_PAYLOADS}",
            value_type="memoryview",
        )
    return view.cast("B")


def _check_tensor_payload(tensor: torch.Tensor, what: str = "the payload") -> None:
    """`UnsupportedPayload` unless ``tensor`` is on the CPU (what `seal_tensor` copies)."""
    if tensor.device.type != "cpu":
        raise UnsupportedPayload(f"{what} is a tensor on {tensor.device}: {_PAYLOADS}", value_type="Tensor")


TAG_BYTES = 8
"""Bytes of the identity tag in a sealed blob's header."""


def _tag_digest(tag: str | bytes) -> bytes:
    """The header's tag: 8 bytes given (an identity tag) as they are, a string's xxh3-64."""
    if isinstance(tag, bytes):
        if len(tag) != TAG_BYTES:
            raise ConfigurationError(f"a sealed blob's identity tag is {TAG_BYTES} bytes (PageIdentity.tag); got {len(tag)}")
        return tag
    if not isinstance(tag, str):
        raise ConfigurationError(f"a sealed blob's tag is a string or {TAG_BYTES} bytes; got {tag!r:.80}")
    return xxhash.xxh3_64_digest(tag.encode("utf-8"))


def _checksum(key: bytes, header: Buffer, payload: Buffer) -> bytes:
    h = xxhash.xxh3_64()
    h.update(len(key).to_bytes(2, "little"))
    h.update(key)
    h.update(header)
    h.update(payload)
    return h.digest()


def new_sealed(nbytes: int) -> bytearray:
    """A zeroed blob with room for a header and ``nbytes`` of payload.

    Write the payload into ``blob[SEAL_HEADER_BYTES:]`` (for example through
    ``torch.frombuffer``) and then call `seal_in_place`: the payload is copied
    once, straight from where it lies. Raises `ValueError` for a negative size.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigurationError(f"a sealed payload has an integer size >= 0; got {nbytes!r}")
    return bytearray(SEAL_HEADER_BYTES + nbytes)


def seal_in_place(key: bytes, blob: bytearray | memoryview, *, tag: str | bytes = "") -> None:
    """Write the header of ``blob`` (made by `new_sealed`, payload filled in),
    binding it to ``key`` and ``tag``. Raises `ValueError` for a bad key or a
    blob shorter than a header."""
    check_key(key)
    view = memoryview(blob).cast("B")
    if len(view) < SEAL_HEADER_BYTES or view.readonly:
        raise ConfigurationError(
            f"seal_in_place needs a writable blob of at least {SEAL_HEADER_BYTES} bytes (from new_sealed); "
            f"got {'a read-only' if view.readonly else 'a writable'} blob of {len(view)} bytes"
        )
    payload = view[SEAL_HEADER_BYTES:]
    _HEADER.pack_into(view, 0, _MAGIC, _VERSION, b"\0\0\0", len(payload), _tag_digest(tag), b"\0" * 8)
    view[_CHECKED:SEAL_HEADER_BYTES] = _checksum(key, view[:_CHECKED], payload)


def seal(key: bytes, payload: Buffer, *, tag: str | bytes = "") -> bytearray:
    """A new blob: a header bound to ``key`` and ``tag``, then a copy of ``payload``.

    Raises `ValueError` for a key that is not 1..256 bytes, `UnsupportedPayload`
    for a payload that is not bytes-like with one contiguous buffer.
    """
    data = _payload_view(payload)
    blob = new_sealed(len(data))
    blob[SEAL_HEADER_BYTES:] = data
    seal_in_place(key, blob, tag=tag)
    return blob


def seal_tensor(key: bytes, tensor: torch.Tensor, *, tag: str | bytes = "") -> bytearray:
    """`seal` of a CPU tensor's bytes (C order, native byte order), copied once
    straight from the tensor, strided or not.

    Raises `UnsupportedPayload` for a tensor that is not on the CPU, `ValueError` for a bad key.
    """
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedPayload(f"seal_tensor seals a tensor; got a {type(tensor).__name__}", value_type=type(tensor).__name__)
    _check_tensor_payload(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    blob = new_sealed(nbytes)
    if nbytes:
        # The values' bytes: a conjugate or negative view (a bit, no bytes of its own) is
        # resolved first, a copy only for such a view. A trailing dimension of stride 1 then
        # lets any tensor be viewed as bytes, and numpy views every such byte view.
        values = tensor.detach().resolve_conj().resolve_neg()
        array = values.unsqueeze(-1).view(torch.uint8).numpy()
        # numpy's copy runs on this thread: torch's copy_ hands a page over 32 KiB to its
        # intra-op threads, whose wake-up on a busy machine was measured at ~16 ms a page.
        dst_array = numpy.frombuffer(blob, dtype=numpy.uint8, count=nbytes, offset=SEAL_HEADER_BYTES)
        numpy.copyto(dst_array.reshape(array.shape), array)
    seal_in_place(key, blob, tag=tag)
    return blob


def open_sealed(key: bytes, blob: Buffer, *, tag: str | bytes = "", nbytes: int | None = None) -> memoryview:
    """The payload of ``blob`` (a view into it), after checking that it was
    sealed under ``key`` and ``tag``, is whole and unchanged, and (when
    ``nbytes`` is given) holds exactly ``nbytes`` bytes.

    Raises `SealBroken` naming the rule it broke (see there); the caller
    treats that page as a miss, and writing it again repairs it.
    """
    view = memoryview(blob).cast("B")

    def broken(rule: str, detail: str) -> SealBroken:
        return SealBroken(f"sealed page {key.hex()[:16]}: {detail}", rule=rule, key=key)

    if len(view) < SEAL_HEADER_BYTES:
        raise broken("header", f"{len(view)} bytes is shorter than the {SEAL_HEADER_BYTES}-byte header")
    magic, version, _, length, tag_digest, checksum = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise broken("header", f"no sealed-blob tag (starts {bytes(view[:4])!r}): another format")
    if version != _VERSION:
        raise broken("version", f"format version {version}; this kvtier reads {_VERSION}")
    if tag_digest != _tag_digest(tag):
        raise broken("identity", f"sealed under another identity tag than {tag!r:.80} (another model, pool, format, geometry or shard)")
    payload = view[SEAL_HEADER_BYTES:]
    if length != len(payload):
        raise broken("length", f"header says {length} payload bytes; {len(payload)} are stored")
    if nbytes is not None and length != nbytes:
        raise broken("length", f"payload of {length} bytes; the caller expects {nbytes}")
    if checksum != _checksum(key, view[:_CHECKED], payload):
        raise broken("checksum", "checksum does not match (bytes changed, or sealed under another key)")
    return payload

