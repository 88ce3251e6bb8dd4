"""Page keys: a chained hash per whole page of tokens, in a namespace.

The key of page ``i`` is ``blake2b(key[i-1] || token ids of page i)``, and the
chain starts from a root derived from a `KeyNamespace`: the model's identity,
the (anchor) pool's name, the page size, the dtype(s) and the layout(s), plus
free-form ``extra`` fields. So:

* a key names the whole prefix up to and including its page, not just the page:
  two prompts share page ``i``'s key only if they share pages ``0..i``;
* the keys of a prefix are a prefix of the keys (``page_keys(ns, t[:n])`` is
  ``page_keys(ns, t)[:n // page_size]``), so an engine can hash incrementally
  (``parent=``) and a lookup can stop at the first miss;
* changing any namespace field changes every key: bytes written by another
  model, pool, page size, dtype or layout are never found, let alone mistaken
  for this one's (collisions would need a 256-bit BLAKE2b collision);
* only whole pages get keys; a partial last page is not stored.

`KeyNamespace` and `KEY_BYTES` are defined in `kvtier.storage.identity` (a
namespace is derived from a page's identity) and importable from here.

Keys are 32-byte ``bytes``; ``key.hex()`` is the printable form. Everything
here is pure and deterministic across processes and machines (no ``hash()``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from kvtier.errors import ConfigurationError
from kvtier.storage.identity import KEY_BYTES, KeyNamespace

__all__ = ["KEY_BYTES", "KeyNamespace", "page_keys", "prefix_keys", "window_keys"]

_TOKEN = struct.Struct("<q")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def page_keys(
    namespace: KeyNamespace,
    tokens: Sequence[int] | torch.Tensor,
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """One key per whole page of ``tokens``, each chained on the one before.

    ``tokens`` are the prompt's token ids (ints in the int64 range, or a 1-D
    integer tensor); a trailing partial page gets no key. With ``parent`` (the
    key of the page just before ``tokens[0]``, from the same namespace) the
    chain continues from it: ``page_keys(ns, a + b)`` equals
    ``page_keys(ns, a) + page_keys(ns, b, parent=page_keys(ns, a)[-1])`` when
    ``len(a)`` is a whole number of pages.

    Raises `ValueError` for a token that is not an integer in range, a tensor
    that is not 1-D integer, or a ``parent`` that is not a key.
    """
    if not isinstance(namespace, KeyNamespace):
        raise ConfigurationError(f"page_keys needs a KeyNamespace (KeyNamespace.for_pool(...)); got {namespace!r:.80}")
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise ConfigurationError(f"token ids must be a sequence of ints or a 1-D integer tensor; got {tokens!r:.80}")
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ConfigurationError(f"token ids must be a 1-D integer tensor; got {tokens.dtype} of shape {tuple(tokens.shape)}")
        ids: Sequence[int] = tokens.tolist()
    else:
        ids = tokens
    size = namespace.page_size
    whole = len(ids) // size
    if parent is None:
        prev = namespace.root()
    elif isinstance(parent, bytes) and len(parent) == KEY_BYTES:
        prev = parent
    else:
        raise ConfigurationError(f"parent must be a {KEY_BYTES}-byte page key; got {parent!r}")
    pack = struct.Struct(f"<{size}q").pack
    keys: list[bytes] = []
    for i in range(whole):
        page = ids[i * size:(i + 1) * size]
        try:
            data = pack(*page)
        except (struct.error, TypeError):
            _raise_bad_token(page, i * size)
            raise
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=b"kvtier-page")
        h.update(data)
        prev = h.digest()
        keys.append(prev)
    return keys


def window_keys(
    namespace: KeyNamespace,
    tokens: Sequence[int] | torch.Tensor,
    pages: int,
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of the last ``pages`` whole pages of ``tokens`` in a pool whose
    stored pages depend on where the prefix ENDS, not only on the tokens up to
    each page: a sliding window keeps only the rows of its last tokens, so page
    ``i`` of a window holds different rows for a prefix ending at page ``i``
    than for one ending two pages later; a recurrent state (page size 1) is the
    state after the whole prefix.

    Each key covers the whole prefix (the `page_keys` key of its last whole
    page) and the page's place counted from the end, so two prefixes that end differently never
    share a window key, while the same prefix always gives the same keys.
    Fewer keys when ``tokens`` has fewer whole pages; none when it is empty.

    ``tokens`` must end on a page boundary: a window cached for a prefix that
    ends mid-page holds other rows than the same prefix cut back to its last
    whole page, and its partial last page is not stored anyway; publish a
    window only at a page boundary. Raises `ValueError` for a length that is
    not a whole number of pages, a ``pages`` that is not a positive integer,
    and as `page_keys` for bad tokens or ``parent``.
    """
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
        raise ConfigurationError(f"window_keys needs pages, a positive integer; got {pages!r}")
    if len(tokens) % namespace.page_size:
        raise ConfigurationError(
            f"window_keys needs a prefix of whole pages of {namespace.page_size} tokens (a window is stored "
            f"for a prefix that ends on a page boundary); got {len(tokens)} tokens"
        )
    keys = page_keys(namespace, tokens, parent=parent)
    if not keys:
        return []
    end = keys[-1]
    first = max(0, len(keys) - pages)
    out = []
    for i in range(first, len(keys)):
        h = hashlib.blake2b(end, digest_size=KEY_BYTES, person=b"kvtier-window")
        # Counted from the end: the same with or without ``parent``.
        h.update((len(keys) - 1 - i).to_bytes(8, "little"))
        out.append(h.digest())
    return out


def prefix_keys(namespace: KeyNamespace, end: bytes, pages: int) -> list[bytes]:
    """Keys of ``pages`` pages of a pool whose rows belong to the prefix that
    ends where it ends (a window, a state, a buffer), for the prefix whose
    last page has `page_keys` key ``end`` in any namespace (e.g. the anchor
    pool's): so such a pool is published at every page boundary of the
    anchor, whatever its own page size (`window_keys` needs the prefix to end
    on a boundary of the pool's own pages).

    Key ``i`` covers ``end`` (the whole prefix), ``namespace`` (this pool's
    layout and rows) and the page's place counted from the end. Two prefixes
    that end differently, or two pools, never share a key; the same prefix
    always gives the same keys. Raises `ValueError` for an ``end`` that is not
    a key or a ``pages`` that is not a positive integer.
    """
    if not isinstance(end, bytes) or len(end) != KEY_BYTES:
        raise ConfigurationError(f"prefix_keys needs end, the {KEY_BYTES}-byte page key of the prefix's last page; got {end!r:.80}")
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
        raise ConfigurationError(f"prefix_keys needs pages, a positive integer; got {pages!r}")
    root = namespace.root()
    out = []
    for i in range(pages):
        h = hashlib.blake2b(end, digest_size=KEY_BYTES, person=b"kvtier-prefix")
        h.update(root)
        h.update((pages - 1 - i).to_bytes(8, "little"))
        out.append(h.digest())
    return out


def _raise_bad_token(page: Sequence[object], offset: int) -> None:
    for j, tok in enumerate(page):
        if isinstance(tok, bool) or not isinstance(tok, int) or not _INT64_MIN <= tok <= _INT64_MAX:
            raise ConfigurationError(f"token ids must be integers in the int64 range; got {tok!r} at position {offset + j}")
