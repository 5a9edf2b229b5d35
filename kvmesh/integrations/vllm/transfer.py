"""The host-device path: chunks between device KV pages and the (pinned) host pool, off
the compute stream.

Saves: the step records an event on the compute stream (its forward has been queued, not
necessarily run); later, on the saver thread, :meth:`Transfer.save` orders the save stream
after that event, gathers the chunk's blocks into a device staging buffer and copies it
``non_blocking`` into the pool slot, then waits for that copy on the saver thread. The step
never waits; the blocks stay valid because vLLM does not free them until the connector
reports the request's saves done (delayed free, ``get_finished``) and does not overwrite
computed blocks of a live request (preemption waits, see ``handle_preemptions``).

Loads: :meth:`Transfer.load` queues, layer by layer, the H2D copy of every chunk's layer
slice into a staging buffer and its scatter into the pages, on the load stream (ordered
after the compute stream's earlier work: the blocks may have belonged to a request whose
kernels are still queued), recording one event per layer. :meth:`Transfer.wait_layer`
makes the compute stream wait for layer ``i``'s event only, so layer ``i + 1``'s copy
overlaps layer ``i``'s attention.

Staging buffers are allocated once, at start: nothing here allocates device or pinned
memory per request (the block index vectors, a few bytes per block, come from torch's
caching allocator). On CPU the streams are no-ops and the same calls run in order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvmesh.core.keys import KVLayout
from kvmesh.core.memory import torch_dtype
from kvmesh.integrations.vllm.device import Event, Stream
from kvmesh.integrations.vllm.layouts import PageLayout


class Transfer:
    def __init__(
        self, page: PageLayout, layers: Sequence[torch.Tensor], layout: KVLayout, chunk_size: int
    ) -> None:
        self.page = page
        self.layers = list(layers)
        self.layout = layout
        self.chunk_size = chunk_size
        self.device = self.layers[0].device if self.layers else torch.device("cpu")
        self.save_stream = Stream(self.device)
        self.load_stream = Stream(self.device)
        dtype = torch_dtype(layout.dtype)
        # Device staging, allocated once: a chunk for the saver thread's gathers, a chunk for
        # whole-chunk loads and a layer-chunk for layer-wise loads (2.03 chunks in all; on
        # CPU none: copies go straight between the pages and the pool).
        chunk = chunk_size * layout.bytes_per_token if self.cuda else 0
        self._save_stage = torch.empty(chunk, dtype=torch.uint8, device=self.device)
        self._chunk_stage = torch.empty(chunk, dtype=torch.uint8, device=self.device)
        self._load_stage = torch.empty(chunk // layout.num_layers, dtype=torch.uint8, device=self.device)
        self._dtype = dtype
        self._layer_events: list[Event | None] = [None] * len(self.layers)
        self._load_done: Event | None = None
        self._local = threading.local()
        self._state_lock = threading.Lock()
        self._first_taken = False

    @property
    def compute(self) -> Stream:
        """vLLM's compute stream: whatever stream is current in the calling (forward) thread,
        looked up at each use (vLLM may run its forward on a stream of its own)."""
        return Stream.compute(self.device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def _view(self, flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return flat[: n * self.layout.itemsize].view(self._dtype).view(shape)

    # -- saves -------------------------------------------------------------------------
    def after_forward(self) -> Event:
        """An event after everything queued on the compute stream so far (this step's
        forward): saves of this step are ordered after it."""
        return self.compute.record()

    def save(self, block_ids: Sequence[int], out: torch.Tensor, after: Event | None) -> None:
        """Gather ``block_ids`` into the host chunk ``out`` ``[L, planes, n, H, D]`` (a pool
        slot); returns once the bytes are in ``out``. Runs on the saver thread only (the
        save staging buffer is that thread's)."""
        stream, staging = self._saver_state()
        with stream.use():
            stream.wait(after)
            if self.cuda:
                stage = self._view(staging, self.layout.shape(out.shape[2]))
                self.page.gather(self.layers, block_ids, stage)  # one gather kernel per plane
                out.copy_(stage, non_blocking=True)  # one D2H into the pinned slot
            else:  # CPU: straight into the slot
                self.page.gather(self.layers, block_ids, out)
            done = stream.record()
        done.synchronize()  # the saver thread waits; the compute stream never does

    def _saver_state(self) -> tuple[Stream, torch.Tensor]:
        """The calling saver thread's own save stream and device staging chunk (several
        savers run at once; the first thread uses the ones allocated at start)."""
        mine = getattr(self._local, "state", None)
        if mine is None:
            with self._state_lock:
                if not self._first_taken:
                    self._first_taken = True
                    mine = (self.save_stream, self._save_stage)
                else:
                    mine = (Stream(self.device), torch.empty_like(self._save_stage))
            self._local.state = mine
        return mine

    # -- loads -------------------------------------------------------------------------
    def load(self, items: Sequence[tuple[torch.Tensor, Sequence[int]]], layerwise: bool = True) -> None:
        """Queue ``chunk -> pages`` for every ``(chunk [L, planes, n, H, D] on the host,
        block ids)``. ``layerwise``: layer-major, one event per layer (the forward waits
        per layer); else chunk by chunk, one H2D and one scatter per plane each (fewer,
        larger copies; the forward waits for all). The host chunks must stay valid until
        :meth:`finish_loads`."""
        self._layer_events = [None] * len(self.layers)
        if not items:
            self._load_done = None
            return
        # Recorded before entering the load stream's context, where the current stream is
        # the load stream itself.
        compute_so_far = self.compute.record()
        with self.load_stream.use():
            self.load_stream.wait(compute_so_far)
            if layerwise:
                self._load_layerwise(items)
            else:
                for chunk, ids in items:
                    self.page.scatter(self._staged(chunk), self.layers, ids)
            self._load_done = self.load_stream.record()
        if not layerwise:
            self._layer_events = [self._load_done] * len(self.layers)

    def load_now(self, items: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> Event:
        """Queue ``chunk -> pages`` for an asynchronous load (its request is not in this
        step's batch): one H2D into staging and one scatter per chunk on the load stream,
        ordered after the compute stream's work so far (the blocks may have been another
        request's). The returned event completes when the pages hold the KV; the host
        chunks must stay valid until then. Leaves this step's synchronous loads alone."""
        compute_so_far = self.compute.record()
        with self.load_stream.use():
            self.load_stream.wait(compute_so_far)
            for chunk, ids in items:
                self.page.scatter(self._staged(chunk), self.layers, ids)
            return self.load_stream.record()

    def _staged(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` on the device: one H2D into the chunk staging buffer (on CUDA)."""
        if not self.cuda:
            return chunk
        src = self._view(self._chunk_stage, tuple(chunk.shape))
        src.copy_(chunk, non_blocking=True)
        return src

    def _load_layerwise(self, items: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        preps = [self.page.prepare(self.layers, ids, chunk.shape[2]) for chunk, ids in items]
        for li, layer in enumerate(self.layers):
            for (chunk, ids), prep in zip(items, preps, strict=True):
                src = chunk[li]
                if self.cuda:
                    stage = self._view(self._load_stage, tuple(src.shape))
                    if src.is_contiguous():  # a whole chunk's layer: one copy
                        stage.copy_(src, non_blocking=True)
                    else:  # a token sub-range: each plane slice is contiguous
                        for p in range(src.shape[0]):
                            stage[p].copy_(src[p], non_blocking=True)
                    src = stage
                self.page.scatter_layer(src, layer, ids, prep)
            self._layer_events[li] = self.load_stream.record()

    def wait_layer(self, index: int) -> None:
        """The compute stream waits for layers ``0..index`` of this step's loads."""
        ev = self._layer_events[index] if 0 <= index < len(self._layer_events) else None
        if ev is not None:
            self.compute.wait(ev)
            for i in range(index + 1):
                self._layer_events[i] = None

    def wait_all_layers(self) -> None:
        """The compute stream waits for every layer (vLLM did not call the layer hooks)."""
        if self._load_done is not None:
            self.compute.wait(self._load_done)
        self._layer_events = [None] * len(self.layers)

    def loads_done(self) -> bool:
        """Whether this step's load copies have completed (never blocks)."""
        return self._load_done is None or self._load_done.query()

    def finish_loads(self) -> None:
        """Block until this step's load copies are done (their host chunks may go)."""
        if self._load_done is not None:
            self._load_done.synchronize()
            self._load_done = None
