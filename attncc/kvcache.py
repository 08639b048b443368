"""KV caches for inference: contiguous per sequence (KVCache) or in pages (PagedKVCache).

New tokens arrive as (batch, new_len, kv_heads, dim) or packed (total, kv_heads, dim), as in
FlashAttention's ``flash_attn_with_kvcache``; storage is head-major, (batch, kv_heads, max_len,
dim) or (num_pages, kv_heads, page_size, dim), so that the kernel streams each head's keys as
contiguous blocks (token-major pages measured 5-25% slower on an H200). Both caches know each
sequence's length on the host (kernels launch without a device sync) and on the device, and
append in place. Mods always see logical positions 0..len-1, never where a token is stored.

The lengths and the block table are the cache's own: ``cache_seqlens`` and ``block_table`` hand
out copies, and lengths change only through methods that check them (append, truncate, reset,
free). The kernel clamps what it reads of them to the cache's storage as well, so that no state
reaches memory outside it.
"""
from __future__ import annotations

import operator
import random

import torch

from .errors import AttnccError

# how the inference kernel finds a sequence's keys (mirrors KV_LENS_* in attn_kv.py.jinja)
KV_LENS_FIXED, KV_LENS_CU, KV_LENS_CACHE = 0, 1, 2


def _check_new(name: str, t, num_kv_heads: int, head_dim: int, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise AttnccError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (3, 4) or tuple(t.shape[-2:]) != (num_kv_heads, head_dim):
        raise AttnccError(f"{name} must be (batch, new_len, {num_kv_heads}, {head_dim}) or packed "
                          f"(total, {num_kv_heads}, {head_dim}) with cu_seqlens, got {tuple(t.shape)}")
    if t.dtype != dtype or t.device != device:
        raise AttnccError(f"{name} is {t.dtype} on {t.device} but the cache holds {dtype} on {device}; "
                          f"convert with .to(cache.dtype) / .to(cache.device)")


def cu_seqlens_lengths(cu, name: str, total: int, exact: bool = False) -> list:
    """Per-sequence lengths of ``cu`` (FlashAttention's cu_seqlens: batch + 1 offsets rising from
    0) over ``total`` packed rows, read on the host (one device sync for a CUDA tensor). The
    offsets end at ``total`` exactly when ``exact`` (tokens to append), else at most there (rows
    past the last offset belong to no sequence)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() == 0:
        got = f"shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise AttnccError(f"{name} must be a 1-d int32 tensor of batch + 1 offsets rising from 0 (FlashAttention's "
                          f"cu_seqlens), got {got}; build it with torch.tensor(offsets, dtype=torch.int32)")
    if cu.dtype not in (torch.int32, torch.int64):
        raise AttnccError(f"{name} must hold integers (int32), got {cu.dtype}; convert with .to(torch.int32)")
    if cu.device.type == "meta":
        raise AttnccError(f"{name} is a meta tensor, which holds no offsets: pass it on the CPU or the inputs' device")
    host = cu.tolist()
    lens = [b - a for a, b in zip(host, host[1:])]
    if host[0] != 0 or any(n < 0 for n in lens) or (host[-1] != total if exact else host[-1] > total):
        end = f"the {total} packed tokens" if exact else f"at most the {total} packed tokens"
        raise AttnccError(f"{name} must rise from 0 to {end}, got {host}")
    return lens


def _new_lengths(k, cu_seqlens) -> list:
    """Tokens appended per sequence: k (B, L, H, D) adds L to each; packed k needs cu_seqlens."""
    if k.dim() == 4:
        if cu_seqlens is not None:
            raise AttnccError("cu_seqlens goes with packed (total, heads, head_dim) keys, not (batch, len, ...)")
        return [k.shape[1]] * k.shape[0]
    if cu_seqlens is None:
        raise AttnccError("packed (total, heads, head_dim) keys need cu_seqlens (batch + 1 offsets)")
    return cu_seqlens_lengths(cu_seqlens, "cu_seqlens", k.shape[0], exact=True)


def _count(n, name: str) -> int:
    """An int argument (a numpy or 0-d torch integer too), not a bool or a float."""
    try:
        if isinstance(n, bool):
            raise TypeError
        return operator.index(n)
    except TypeError:
        raise AttnccError(f"{name} must be an int, got {n!r}") from None


class _Cache:
    """What both caches share: lengths, appending, and the arguments of the inference kernel."""

    def __init__(self, num_kv_heads, head_dim, dtype, device, head_dim_v, value_from_key):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.dtype, self.device = dtype, torch.device(device)
        self.value_from_key = value_from_key
        if value_from_key and self.head_dim_v > head_dim:
            raise AttnccError(f"value_from_key reads values as the first head_dim_v channels of the keys: "
                              f"head_dim_v ({self.head_dim_v}) must not exceed head_dim ({head_dim})")
        self._lens: list = []
        self._lens_dev = None

    @property
    def batch(self) -> int:
        return len(self._lens)

    def lengths(self) -> list:
        """Tokens stored per sequence (host list; no device sync)."""
        return list(self._lens)

    @property
    def seqlens(self) -> torch.Tensor:
        """int32 (batch,) on the cache's device: tokens stored per sequence. A copy: editing it
        changes nothing (shorten a sequence with ``truncate``)."""
        return self._seqlens_dev().clone()

    cache_seqlens = seqlens  # FlashAttention's name for it

    def _seqlens_dev(self) -> torch.Tensor:
        """The lengths the kernel reads: made once per change of the lengths, never handed out."""
        if self._lens_dev is None:
            self._lens_dev = torch.tensor(self._lens, dtype=torch.int32, device=self.device)
        return self._lens_dev

    def _sequence(self, b) -> int:
        """Sequence number b, checked: 0 <= b < batch (no negative indices from the end)."""
        b = _count(b, "the sequence number")
        if not 0 <= b < len(self._lens):
            raise AttnccError(f"no sequence {b}: the cache holds {len(self._lens)} (numbered 0 to "
                              f"{len(self._lens) - 1}; negative numbers do not count from the end)")
        return b

    def truncate(self, b: int, length: int) -> None:
        """Keep the first ``length`` tokens of sequence b and forget the rest (a speculative
        decoder's rejected draft tokens, say); a paged cache takes back the pages it no longer
        needs. The lengths are the cache's own: this is how a sequence gets shorter."""
        b = self._sequence(b)
        length = _count(length, "length")
        if not 0 <= length <= self._lens[b]:
            raise AttnccError(f"truncate: sequence {b} holds {self._lens[b]} tokens, so it can keep 0 to "
                              f"{self._lens[b]} of them, not {length}; append adds tokens")
        self._lens[b] = length
        self._lens_dev = None
        self._release(b)

    def _release(self, b: int) -> None:
        """Give back storage sequence b no longer needs (after it got shorter)."""

    def lengths_after(self, k, v=None, cu_seqlens=None) -> list:
        """Check new tokens as ``append`` takes them and return every sequence's length after
        that append, changing nothing."""
        _check_new("k", k, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        if self.value_from_key:
            if v is not None:
                raise AttnccError("this cache reads values from the keys (value_from_key=True): append k only")
        else:
            if v is None:
                raise AttnccError("append needs the new values v as well as the keys k")
            _check_new("v", v, self.num_kv_heads, self.head_dim_v, self.dtype, self.device)
            if v.shape[:-1] != k.shape[:-1]:
                raise AttnccError(f"k and v must have the same tokens, got {tuple(k.shape)} and {tuple(v.shape)}")
        new = _new_lengths(k, cu_seqlens)
        self._check_batch(len(new))
        old = self._lens + [0] * (len(new) - len(self._lens))
        return [n + (new[b] if b < len(new) else 0) for b, n in enumerate(old)]

    def append(self, k, v=None, cu_seqlens=None) -> None:
        """Write new tokens after each sequence's last one: k, v (batch, new_len, kv_heads, dim)
        or packed (total, kv_heads, dim) with cu_seqlens (batch + 1 offsets, varlen). With
        value_from_key the values are part of k and v is not given. All or nothing: a failed
        append leaves the cache as it was."""
        self._write(k, v, self.lengths_after(k, v, cu_seqlens))

    def _write(self, k, v, after: list) -> None:
        """append, for tokens that ``lengths_after`` checked and found to give lengths ``after``."""
        before = self._lens + [0] * (len(after) - len(self._lens))
        self._reserve({b: n for b, (n, m) in enumerate(zip(after, before)) if n != m}, len(after))
        seq, pos = [], []
        for b, (n, m) in enumerate(zip(after, before)):
            seq += [b] * (n - m)
            pos += range(m, n)
        if seq:
            outer, slot = self._locate(seq, pos)
            self._k[outer, :, slot] = k.reshape(-1, self.num_kv_heads, self.head_dim)
            if not self.value_from_key:
                self._v[outer, :, slot] = v.reshape(-1, self.num_kv_heads, self.head_dim_v)
        self._lens = after
        self._lens_dev = None

    def _check_batch(self, n: int) -> None:
        """Raise if the cache cannot hold n sequences."""

    def _views(self):
        """Keys and values as the kernel's 4-d (outer, kv_heads, tokens, dim) views."""
        return self._k, (self._k[..., :self.head_dim_v] if self.value_from_key else self._v)


class KVCache(_Cache):
    """A contiguous KV cache: k, v (batch, num_kv_heads, max_len, head_dim) plus lengths.

    ``append`` writes new tokens in place; ``attncc.attention_with_kvcache(q, cache, ...)``
    attends new queries at positions ``len - q_len + i``, so causal, sliding-window and ALiBi
    mods see true positions. ``value_from_key=True`` stores one tensor whose first
    ``head_dim_v`` channels are the values (MLA's latent cache)."""

    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=torch.bfloat16,
                 device="cuda", *, head_dim_v: int | None = None, value_from_key: bool = False):
        super().__init__(num_kv_heads, head_dim, dtype, device, head_dim_v, value_from_key)
        self.max_len = max_len
        self._k = torch.zeros(batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self._v = None if value_from_key else torch.zeros(batch, num_kv_heads, max_len, self.head_dim_v,
                                                          dtype=dtype, device=device)
        self._lens = [0] * batch
        self.device = self._k.device  # "cuda" becomes "cuda:0": what tensors report

    @property
    def k(self) -> torch.Tensor:
        return self._k

    @property
    def v(self) -> torch.Tensor:
        return self._k[..., :self.head_dim_v] if self.value_from_key else self._v

    def _check_batch(self, n: int) -> None:
        if n > len(self._lens):
            raise AttnccError(f"this KVCache holds {len(self._lens)} sequences; appended keys have {n} "
                              "(create the cache with a larger batch)")

    def _reserve(self, grow: dict, n_seqs: int):
        for b, length in grow.items():
            if length > self.max_len:
                raise AttnccError(f"KVCache overflow: sequence {b} would hold {length} tokens but max_len is "
                                  f"{self.max_len}; create the cache with a larger max_len")

    def _locate(self, seq, pos):
        dev = self.device
        return torch.tensor(seq, device=dev), torch.tensor(pos, device=dev)

    def reset(self, b: int | None = None) -> None:
        """Forget sequence b's tokens (every sequence's when b is None)."""
        for i in range(len(self._lens)) if b is None else [self._sequence(b)]:
            self._lens[i] = 0
        self._lens_dev = None

    def kernel_args(self) -> dict:
        """attn_kv's arguments for this cache (attncc.inference): its storage as 4-d views and its
        own lengths, which are not for editing (the kernel clamps them to max_len regardless)."""
        k4, v4 = self._views()
        return dict(k=k4, v=v4, kv_lens=self._seqlens_dev(), kv_mode=KV_LENS_CACHE, block_table=None, page_size=1)

    def __repr__(self):
        return (f"KVCache(batch={self.batch}, max_len={self.max_len}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, head_dim_v={self.head_dim_v}, {self.dtype}, lengths={self._lens})")


class PagedKVCache(_Cache):
    """A paged KV cache: ``num_pages`` pages of ``page_size`` tokens shared by all sequences.

    Each sequence owns a list of pages (its row of ``block_table``); ``append`` takes pages from
    the free list as a sequence grows and fails with a clear error when none are left;
    ``free(b)`` returns a finished sequence's pages. Kernels read keys through the block table,
    so results equal those of a contiguous cache. ``seed`` shuffles the free list (pages of a
    sequence then scatter across memory, as in a long-running server)."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype=torch.bfloat16,
                 device="cuda", *, head_dim_v: int | None = None, value_from_key: bool = False,
                 seed: int | None = None):
        if not isinstance(page_size, int) or page_size < 1:
            raise AttnccError(f"page_size must be a positive int (16 to 256 are typical), got {page_size!r}")
        if not isinstance(num_pages, int) or num_pages < 1:
            raise AttnccError(f"num_pages must be a positive int, got {num_pages!r}")
        super().__init__(num_kv_heads, head_dim, dtype, device, head_dim_v, value_from_key)
        self.num_pages, self.page_size = num_pages, page_size
        self._k = torch.zeros(num_pages, num_kv_heads, page_size, head_dim, dtype=dtype, device=device)
        self._v = None if value_from_key else torch.zeros(num_pages, num_kv_heads, page_size, self.head_dim_v,
                                                          dtype=dtype, device=device)
        self.device = self._k.device
        self._free = list(range(num_pages))
        if seed is not None:
            random.Random(seed).shuffle(self._free)
        self._pages: list = []
        self._table = None

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def _reserve(self, grow: dict, n_seqs: int):
        """Take pages for sequences growing to the given lengths, for n_seqs sequences in all
        (new ones included)."""
        have = lambda b: len(self._pages[b]) if b < len(self._pages) else 0
        need = {b: max(-(-length // self.page_size) - have(b), 0) for b, length in grow.items()}
        if sum(need.values()) > len(self._free):
            short = ", ".join(f"sequence {b} needs {n} more" for b, n in need.items() if n)
            raise AttnccError(
                f"PagedKVCache out of pages: {short} page(s) of {self.page_size} tokens but {len(self._free)} "
                f"of {self.num_pages} are free; free finished sequences with cache.free(b) or create the cache "
                "with more pages")
        self._pages += [[] for _ in range(n_seqs - len(self._pages))]
        for b, n in need.items():
            self._pages[b] += self._free[:n]
            del self._free[:n]
        self._table = None

    def _locate(self, seq, pos):
        ps, dev = self.page_size, self.device
        pages = [self._pages[b][p // ps] for b, p in zip(seq, pos)]
        return torch.tensor(pages, device=dev), torch.tensor([p % ps for p in pos], device=dev)

    def free(self, b: int) -> None:
        """Return sequence b's pages to the free list; its length becomes 0."""
        self.truncate(b, 0)

    def _release(self, b: int) -> None:
        keep = -(-self._lens[b] // self.page_size)
        self._free += self._pages[b][keep:]
        del self._pages[b][keep:]
        self._table = None

    @property
    def block_table(self) -> torch.Tensor:
        """int32 (batch, max pages of a sequence) on the cache's device: page numbers of each
        sequence, in order, 0 past a sequence's last page. A copy: editing it changes nothing
        (the cache hands out pages in append and takes them back in truncate and free)."""
        return self._block_table().clone()

    def _block_table(self) -> torch.Tensor:
        """The table the kernel reads: made once per change of the pages, never handed out."""
        if self._table is None:
            width = max([len(p) for p in self._pages] + [1])
            rows = [p + [0] * (width - len(p)) for p in self._pages] or [[0]]
            self._table = torch.tensor(rows, dtype=torch.int32, device=self.device)
        return self._table

    def kernel_args(self) -> dict:
        """attn_kv's arguments for this cache (attncc.inference): its pages as 4-d views and its
        own lengths and block table, which are not for editing (the kernel keeps its reads in the
        pool and in a sequence's row of the table regardless)."""
        k4, v4 = self._views()
        return dict(k=k4, v=v4, kv_lens=self._seqlens_dev(), kv_mode=KV_LENS_CACHE, block_table=self._block_table(),
                    page_size=self.page_size)

    def __repr__(self):
        return (f"PagedKVCache(pages={self.num_pages}x{self.page_size}, free={len(self._free)}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {self.dtype}, lengths={self._lens})")
