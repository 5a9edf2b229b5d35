"""A lookup's result: every holder's match, kept as counts and turned into ranges on demand.

:meth:`kvmesh.index.BlockIndex.match` returns a :class:`ReplicaMatches`: a read-only
mapping replica → :class:`PrefixMatch` like the dict it used to return, whose ranges are
built only for the replicas someone asks about (the router asks about the one it picked).
The scorers read :meth:`ReplicaMatches.medium_tokens` instead: the tokens every replica has
per medium, one array for the fleet, so scoring 1,000 replicas is a few numpy calls.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import numpy as np

from kvmesh.index.matching import replica_ranges
from kvmesh.index.media import COLUMNS, SLOT_OF_COLUMN, AnyMedium, Media, MediaView, OtherMedium, column
from kvmesh.index.prefix import PrefixMatch

_NO_MEDIA = Media()  # matches built from ranges name their media themselves


class ReplicaMatches(Mapping[str, PrefixMatch]):
    """Replica name → its :class:`PrefixMatch`; only replicas with a match are keys.

    ``rid_names[rid]`` names replica id ``rid`` (``rids`` maps names back);
    ``effs``/``counts``: :func:`kvmesh.index.matching.medium_counts` of the lookup;
    ``media``: the medium of each bit of a replica's byte, as the index knew them.
    """

    __slots__ = ("_bs", "_built", "_effs", "_holders", "_media", "_names", "_rids", "_tokens")

    def __init__(
        self,
        rid_names: tuple[str | None, ...],
        rids: Mapping[str, int],
        effs: list[int],
        counts: np.ndarray,
        block_size: int,
        media: MediaView = _NO_MEDIA.view,
    ) -> None:
        self._names = rid_names
        self._rids = rids
        self._effs = effs
        self._bs = block_size
        self._media = media
        self._tokens = counts * block_size
        self._holders: list[str] | None = None
        self._built: dict[str, PrefixMatch] = {}

    @classmethod
    def of(cls, matches: Mapping[str, PrefixMatch], media: MediaView | None = None) -> ReplicaMatches:
        """From matches already built (several block sizes combined, or none); ``media``: the
        index's (else the media are taken from the matches' ranges)."""
        names = (*matches,)
        counts = np.zeros((len(names), COLUMNS), np.int64)
        by_slot = list((media or _NO_MEDIA.view).by_slot)
        for j, m in enumerate(matches.values()):
            for med, count in m.tokens_by_medium().items():
                counts[j, column(med)] += count
                if isinstance(med, OtherMedium):
                    by_slot[med.slot] = med
        view = media if media is not None else _view(tuple(by_slot))
        self = cls(names, {n: i for i, n in enumerate(names)}, [], counts, 1, view)
        self._built = dict(matches)
        return self

    def medium_tokens(self) -> tuple[tuple[str | None, ...], np.ndarray]:
        """``(rid_names, tokens)``: ``tokens[rid, c]`` is how many prompt tokens replica id
        ``rid`` has matched in the medium of column ``c`` (a :class:`Medium` value,
        ``Medium.GPU`` = 3, then the named media: see :meth:`media`); rows may run past
        ``rid_names`` (zeros) or stop short of it (no match). ``rid_names`` is the same
        object for every lookup while the index's replicas do not change, so a caller may
        cache what it derives from it (see ``ReplicaTable.align``)."""
        return self._names, self._tokens

    def media(self) -> tuple[str, ...]:
        """The medium name of each column of :meth:`medium_tokens` ("": not used yet); the
        same object while the index's media do not change."""
        return _columns(self._media.by_slot)

    def _holder_names(self) -> list[str]:
        if self._holders is None:
            names = self._names
            rows = np.flatnonzero(self._tokens.any(axis=1)).tolist()
            self._holders = [n for n in (names[r] for r in rows if r < len(names)) if n is not None]
        return self._holders

    def __getitem__(self, name: str) -> PrefixMatch:
        got = self._built.get(name)
        if got is not None:
            return got
        rid = self._rids.get(name)
        if rid is None or rid >= len(self._tokens) or not self._tokens[rid].any():
            raise KeyError(name)
        got = self._built[name] = PrefixMatch(replica_ranges(self._effs, rid, self._bs, self._media))
        return got

    def __contains__(self, name: object) -> bool:
        if name in self._built:
            return True
        rid = self._rids.get(name) if isinstance(name, str) else None
        return rid is not None and rid < len(self._tokens) and bool(self._tokens[rid].any())

    def __iter__(self) -> Iterator[str]:
        return iter(self._holder_names())

    def __len__(self) -> int:
        return len(self._holder_names())

    def __bool__(self) -> bool:
        # Asked per request ("any match?"): without naming the holders.
        return bool(self._built) or bool(np.count_nonzero(self._tokens))

    def __repr__(self) -> str:
        return f"ReplicaMatches({dict(self.items())!r})"


_COLUMN_NAMES: dict[tuple[AnyMedium, ...], tuple[str, ...]] = {}


def _columns(by_slot: tuple[AnyMedium, ...]) -> tuple[str, ...]:
    got = _COLUMN_NAMES.get(by_slot)
    if got is None:
        if len(_COLUMN_NAMES) >= 64:  # bounded: an index's media change at most four times
            _COLUMN_NAMES.clear()
        got = _COLUMN_NAMES[by_slot] = tuple(by_slot[SLOT_OF_COLUMN[c]].name for c in range(COLUMNS))
    return got


@functools.lru_cache(maxsize=64)
def _view(by_slot: tuple[AnyMedium, ...]) -> MediaView:
    return MediaView.of(by_slot)  # its tables take ~1 ms to make: once per set of media
