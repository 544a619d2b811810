"""Page checksums of the NVMe row store: every page written back gets one, every page read is
checked against it, so a page file changed behind the store's back (another process, a bad
block, a lost or misdirected write) stops the run instead of training on garbage.

The checksum is a multilinear hash: the page's 64-bit words times fixed odd 64-bit keys, and
the page number times one more, summed modulo 2^64; the top 32 bits are kept (4 B a page in
host memory, like a CRC-32). Why this and not CRC-32C: it is computed for a batch of pages in
a few torch ops, which release the GIL and cost no Python per page (CRC-32C has no fast
implementation in the standard library or torch, and zlib's CRC-32 is a Python call per page
that holds the GIL), at the same collision odds for random garbage (2^-32); the page number in
the hash also catches a page written at another page's place, which a CRC of the contents does
not. The checksums live in memory for the run's life: the page files are scratch, and after a
kill the checkpoint, not the files, is what a run resumes from.
"""

from __future__ import annotations

import torch

__all__ = ["PageChecksumError", "page_sums"]

_KEYS: dict[int, torch.Tensor] = {}
_CHUNK = 256  # pages hashed at once (a 1 MiB temporary of 4 KiB pages)


def _keys(words: int) -> torch.Tensor:
    """`words` + 1 fixed odd 64-bit keys (the last one multiplies the page number)."""
    if words not in _KEYS:
        gen = torch.Generator().manual_seed(0x5EED_9A6E)
        keys = torch.randint(-(2**63), 2**63 - 1, (words + 1,), dtype=torch.int64, generator=gen)
        _KEYS[words] = keys | 1
    return _KEYS[words]


def page_sums(buf: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The checksums (int32) of the pages `pages` held in rows `slots` of `buf` ([n, page bytes
    / 4] fp32, a page a row)."""
    words = buf.view(torch.int64)
    keys = _keys(words.shape[1])
    out = torch.empty(len(slots), dtype=torch.int32)
    scratch = torch.empty(min(_CHUNK, len(slots)), words.shape[1], dtype=torch.int64)
    for lo in range(0, len(slots), _CHUNK):
        s, p = slots[lo : lo + _CHUNK], pages[lo : lo + _CHUNK]
        part = torch.index_select(words, 0, s, out=scratch[: len(s)])  # no temporaries
        total = part.mul_(keys[:-1]).sum(1).add_(p * keys[-1])  # int64: wraps modulo 2^64
        out[lo : lo + _CHUNK] = total.bitwise_right_shift_(32).to(torch.int32)
    return out


class PageChecksumError(RuntimeError):
    """A page read back from a page file is not what the store wrote there."""
