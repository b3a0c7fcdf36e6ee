"""generation.fused_loop: the fused step's CUDA-graph loop: captured once, replayed exactly, its
allocator policy, and step-by-step decoding where a capture fails."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import FastGenerationConfig, fast_generate
from tests.fastgen_helpers import (  # noqa: F401  (_fresh: autouse)
    Counting,
    _fresh,
    batch,
    eager_generate,
    eos_prone_policy,
    gpu,
    graph_config,
    greedy,
    lora_policy,
)


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("attention, graph_steps", [("matmul", None), ("kernel", None), ("kernel", 1)])
def test_gpu_fused_loop_is_one_cuda_graph_per_check_every_tokens_captured_once_and_equal_to_eager(attention,
                                                                                                 graph_steps):
    model = eos_prone_policy().cuda()
    kept = FastGenerationConfig(decode_loop="graph", check_every=4, release_after_sampling=False,
                                decode_attention=attention, graph_steps=graph_steps)
    stats = generation.GRAPH_STATS.fused
    captures0, replays0 = stats.captures, stats.replays
    for seed, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [2, 13, 9, 9])):
        ids, mask = (t.cuda() for t in batch(lengths, seed=seed))
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=kept),
                           eager_generate(model, ids, mask)), lengths
        assert stats.attention == attention
    assert stats.capture_errors == [] and stats.captures == captures0 + 1, "captured once, replayed after"
    assert stats.replays - replays0 >= 3 * 2, "12 new tokens in replays of 4"
    # the default: the graph goes with the cache
    dropped = FastGenerationConfig(decode_loop="graph", check_every=4, decode_attention=attention,
                                   graph_steps=graph_steps)
    allocated = []
    for expected in (1, 2, 3, 4):  # the first still replays the kept graph, then frees it; then a capture each
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=dropped),
                           eager_generate(model, ids, mask))
        assert stats.captures == captures0 + expected and not generation._MERGED[model].chunks
        allocated.append(torch.cuda.memory_allocated())
    # a capture per call holds nothing after it (a new side stream each held its cuBLAS workspace: +33 MiB a call)
    assert allocated[1] == allocated[2] == allocated[3], allocated


def test_capture_keeps_the_allocator_cache_unless_short_of_room_and_tries_once_more_after_running_out(monkeypatch):
    """The fused loop's cache rules (CUDA only: its torch.cuda calls recorded here with stand-ins). Before the
    prefill (``make_room``) the cache is emptied only where less than the pool the last capture took, or a
    quarter of the memory the process may use, is left (``torch.cuda.graph`` empties it at every capture, so
    the next round's caches moved); at the capture only where that pool does not fit, and after a capture that
    ran out of memory, which is tried once more; every capture begun is ended. The capture never waits for the
    device (the host records while the prefill runs): a ``synchronize`` would be in the log."""
    from contextlib import nullcontext

    from grpo_patches.generation import fused_loop

    log, reserved, free, fraction, fail = [], [0], [10_000], [1.0], []

    class Graph:
        def capture_begin(self, capture_error_mode):
            log.append("begin")

        def capture_end(self):
            log.append("end")

    streams = []

    class Stream:
        def __init__(self):
            streams.append(self)

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(fused_loop, "_SIDE", {})
    current = Stream()  # the current stream's stand-in; every other Stream() is a side stream
    streams.clear()
    for name, value in {"Stream": Stream, "current_stream": lambda: current, "stream": lambda s: nullcontext(),
                        "current_device": lambda: 0,
                        "synchronize": lambda: log.append("synchronize"), "CUDAGraph": Graph,
                        "memory_reserved": lambda: reserved[0],
                        "empty_cache": lambda: log.append("empty_cache"), "mem_get_info": lambda: (free[0], 10_000),
                        "get_per_process_memory_fraction": lambda: fraction[0]}.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)

    def step():
        if log[-1:] == ["begin"] and fail:  # inside a capture (its steps log nothing)
            fail.pop()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        reserved[0] += 10

    def capture(need):
        log.clear()
        reserved[0] = 0
        return fused_loop._capture(step, (), 4, need)[1], list(log)

    def room_made(need, graphs=None, device="cuda", held=0):
        log.clear()
        reserved[0] = held  # what the allocator holds (the training phase's cached blocks)
        fused_loop.make_room({} if graphs is None else graphs, torch.device(device),
                             fused_loop.FusedLoopStats(graph_pool_bytes=need))
        return list(log)

    assert capture(0) == (40, ["begin", "end"]), "no need known: the cache stays"
    assert capture(40) == (40, ["begin", "end"]), "room for the pool beside the cache"
    assert room_made(40) == [], "room for the pool and over a quarter free"
    free[0] = 30
    assert capture(40) == (40, ["empty_cache", "begin", "end"]), "short of free memory"
    assert room_made(40) == ["empty_cache"], "short of free memory"
    assert room_made(40, graphs={fused_loop._FAILED: True}) == [], "no capture over these caches: nothing to do"
    assert room_made(40, device="cpu") == [], "no graphs on the CPU"
    free[0] = 2_600
    assert room_made(40) == [], "over a quarter of the device free"
    free[0] = 2_400
    assert room_made(0) == ["empty_cache"], "under a quarter free: defragmented before the prefill"
    assert capture(0) == (40, ["begin", "end"]), "under a quarter free: not at the capture (it would wait)"
    free[0], fraction[0] = 10_000, 0.5  # within the process's fraction: 5000 - 10 (the warm-up step's) left
    assert capture(40) == (40, ["begin", "end"]), "room within the memory fraction"
    fraction[0] = 0.004  # 40 - 10
    assert capture(40) == (40, ["empty_cache", "begin", "end"]), "short within the memory fraction"
    fraction[0] = 0.5
    assert room_made(40, held=3_700) == [], "over a quarter of the allowed 5000 left"
    assert room_made(40, held=3_800) == ["empty_cache"], "under a quarter of the allowed 5000 left"
    fraction[0], fail[:] = 1.0, [True]
    assert capture(0) == (40, ["begin", "end", "empty_cache", "begin", "end"]), "out of memory: emptied, again"
    fail[:] = [True, True]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        capture(0)
    assert log == ["begin", "end", "empty_cache", "begin", "end"]
    # one side stream for every capture: PyTorch keeps a cuBLAS workspace per stream until the process ends
    assert streams == [fused_loop._SIDE[0]] and len(fused_loop._SIDE) == 1, "nine captures, one side stream"


@gpu
@pytest.mark.slow
def test_gpu_kept_graph_is_replayed_exactly_while_caches_and_buffer_are_back_at_its_addresses(monkeypatch):
    """keep_graph with release_after_sampling: caches and merged buffer freed after every call, the graph
    kept. Each call's addresses (weights, merged buffer, K/V caches) decide: those the graph was recorded
    over -> replay, else capture. A graph replayed over moved caches reads freed memory: after the weight
    change its tokens would be the old weights' (the allocator decides where the blocks land, so the test
    follows the addresses each call saw)."""
    from grpo_patches.generation import fused_loop

    model = eos_prone_policy().cuda()
    config = FastGenerationConfig(decode_loop="graph", check_every=4, keep_graph=True)
    stats = generation.GRAPH_STATS.fused
    ids, mask = (t.cuda() for t in batch([5, 9, 7, 3]))
    # Everything the calls are compared with is computed first, so nothing else allocates between the calls.
    noise = {n: torch.randn_like(p) * 0.05 for n, p in model.named_parameters() if p.requires_grad}
    stepped = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in stepped.named_parameters():
            if n in noise:
                p.add_(noise[n])
    expected, expected_stepped = eager_generate(model, ids, mask), eager_generate(stepped, ids, mask)
    assert not torch.equal(expected, expected_stepped), "a vacuous weight change"
    seen, addresses = [], fused_loop._addresses
    monkeypatch.setattr(fused_loop, "_addresses", lambda tensors: seen.append(addresses(tensors)) or seen[-1])
    captured = []
    for call in range(6):
        if call == 4:  # an optimizer step in between: the replay reads the refreshed buffer
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in noise:
                        p.add_(noise[n])
        before = stats.captures
        got = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(got, expected_stepped if call >= 4 else expected), call
        assert not generation._MERGED[model].chunks and not generation._POOLS[model].caches, "released"
        assert len(seen) == call + 1
        captured.append(stats.captures - before)
        assert captured[-1] == int(call == 0 or seen[-1] != seen[-2]), (call, captured)
    assert stats.capture_errors == [] and 0 in captured, f"the kept graph was never replayed: {captured}"
    assert stats.graph_pool_bytes > 0
    # Keep the released tensors alive, so the next call's caches and buffer land elsewhere.
    merged, pool, held = generation._MERGED[model], generation._POOLS[model], []
    release_merged, release_pool = merged.release, pool.release
    merged.release = lambda: (held.extend(merged.chunks), release_merged())
    pool.release = lambda keep_graphs=False: (held.extend(pool.caches.values()), release_pool(keep_graphs))
    try:
        captures = stats.captures
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), expected_stepped)
        assert held and stats.captures == captures + int(seen[-1] != seen[-2])
        captures, moves = stats.captures, merged.moves
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), expected_stepped)
        assert merged.moves == moves + 1 and seen[-1] != seen[-2]
        assert stats.captures == captures + 1, "moved: captured anew, not replayed"
    finally:
        del merged.release, pool.release


def test_fused_loop_whose_graph_capture_fails_decodes_step_by_step_after_the_warm_up_step(monkeypatch):
    """The fallback path: a capture that fails after its real warm-up step leaves the loop to finish
    step by step from there (same tokens, no step run twice), warns once and does not try again over
    the same caches."""
    from grpo_patches.generation import fused_loop

    model = eos_prone_policy()
    ids, mask = batch([5, 9, 7, 3])
    eager = eager_generate(model, ids, mask)
    attempts = []

    def failing_capture(step, args, chunk, need):
        step(*args)  # the real warm-up step, as _capture runs it
        attempts.append(chunk)
        raise RuntimeError("simulated: operation not permitted when stream is capturing")

    stats = generation.GRAPH_STATS.fused
    errors0 = len(stats.capture_errors)
    reference = Counting()  # no graphs at all: step by step from the first token
    plain = fast_generate(model, ids, mask, generation_config=greedy(),
                          config=graph_config(reference, check_every=4, release_after_sampling=False))
    monkeypatch.setattr(fused_loop, "_graphs_on", lambda device: True)
    monkeypatch.setattr(fused_loop, "_room", lambda: (1 << 40, 1 << 40))  # the allocator's room: plenty
    monkeypatch.setattr(fused_loop, "_capture", failing_capture)
    fallback = Counting()
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        first = fast_generate(model, ids, mask, generation_config=greedy(),
                              config=graph_config(fallback, check_every=4, release_after_sampling=False))
    assert torch.equal(plain, eager) and torch.equal(first, eager)
    assert fallback.runs == reference.runs, "the warm-up step counts: none is run twice, none skipped"
    second = fast_generate(model, ids, mask, generation_config=greedy(),
                           config=graph_config(fallback, check_every=4, release_after_sampling=False))
    assert torch.equal(second, eager)
    assert len(attempts) == 1 and len(stats.capture_errors) == errors0 + 1, "one attempt over the same caches"


@pytest.mark.parametrize("graph_steps", [None, 1, 2])
def test_a_graph_of_graph_steps_is_replayed_until_the_next_check_and_gives_the_stepped_tokens(monkeypatch,
                                                                                            graph_steps):
    """The loop's CUDA graph (a stand-in here that runs the compiled step when replayed) holds
    ``graph_steps`` decode steps (``check_every`` by default) and is replayed ``check_every / graph_steps``
    times between host checks: the same tokens as decoding step by step, no step run twice or skipped."""
    from grpo_patches.generation import fused_loop

    model = eos_prone_policy()
    ids, mask = batch([5, 9, 7, 3])
    reference = Counting()
    plain = fast_generate(model, ids, mask, generation_config=greedy(),
                          config=graph_config(reference, check_every=4, release_after_sampling=False))
    captured = []

    class Graph:
        def __init__(self, step, args, steps):
            self.replay = lambda: [step(*args) for _ in range(steps)]

    def capture(step, args, steps, need):
        step(*args)  # the real warm-up step, as _capture runs it
        captured.append(steps)
        return Graph(step, args, steps), 0

    monkeypatch.setattr(fused_loop, "_graphs_on", lambda device: True)
    monkeypatch.setattr(fused_loop, "_room", lambda: (captured.append("room") or 1 << 40, 1 << 40))  # plenty
    monkeypatch.setattr(fused_loop, "_capture", capture)
    graphed = Counting()
    config = graph_config(graphed, check_every=4, graph_steps=graph_steps, release_after_sampling=False)
    assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), plain)
    assert captured == ["room", graph_steps or 4], "the room made before the prefill, then one capture"
    steps = graph_steps or 4  # the last graph runs whole: past the last token by less than one graph
    assert graphed.runs == reference.runs + (1 - reference.runs) % steps, "every decode step once"
    with pytest.raises(ValueError, match="graph_steps=3 must be None or a positive divisor of check_every=4"):
        FastGenerationConfig(check_every=4, graph_steps=3)


def test_pool_release_keeps_captured_graphs_only_when_asked_and_forgets_a_failed_capture():
    from grpo_patches.generation.cache import StaticCachePool
    from grpo_patches.generation.fused_loop import _FAILED, _Captured

    pool = StaticCachePool()
    pool.grow(32)
    pool.get(lora_policy(), 2)
    captured, uncaptured = _Captured(state=(), graph=object()), _Captured(state=())
    graphs = {(2, 32): captured, (4, 32): uncaptured, _FAILED: True}
    pool.graphs = dict(graphs)
    pool.release(keep_graphs=True)
    assert pool.caches == {} and pool.graphs == {(2, 32): captured}, "the graph stays; a failure is forgotten"
    pool.graphs = dict(graphs)
    pool.release()
    assert pool.graphs == {}
    pool.graphs = {(2, 32): captured}
    pool.grow(64)  # a longer cache: no graph recorded over the old length replays
    assert pool.graphs == {}
